// Subcommands of the `relay` binary register themselves here: each cmd_*.cpp defines a static
// CommandRegistrar, so adding a command adds a file and edits nothing else.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace relay::cli {

struct Command {
  std::string name;
  // Adds the subcommand's options to `sub` and returns the function that runs it (exit code).
  std::function<std::function<int()>(CLI::App& sub)> setup;
  std::string description;
};

std::vector<Command>& commands();

struct CommandRegistrar {
  explicit CommandRegistrar(Command c) { commands().push_back(std::move(c)); }
};

// The embedded default model directory (models/relay-demo-moe in the source tree, or next to the
// installed binary).
std::string default_model_dir();

}  // namespace relay::cli
