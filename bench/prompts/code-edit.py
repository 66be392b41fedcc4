# A code-editing prompt for `relay bench --prompt-file` (n-gram drafting on real text): a file,
# then the request to write it out again with one name changed, and the start of the answer.

import math


def mean_and_deviation(values):
    """The mean of `values` and their standard deviation."""
    if not values:
        raise ValueError("no values")
    total = 0.0
    for value in values:
        total += value
    mean = total / len(values)
    squares = 0.0
    for value in values:
        squares += (value - mean) ** 2
    return mean, math.sqrt(squares / len(values))


def normalise(values):
    """`values` shifted and scaled to mean 0 and deviation 1."""
    mean, deviation = mean_and_deviation(values)
    if deviation == 0.0:
        return [0.0 for _ in values]
    return [(value - mean) / deviation for value in values]


# The same file with `values` renamed to `samples`:

import math


def mean_and_deviation(samples):
