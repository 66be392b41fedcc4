// `relay`: one binary for every job (generate, serve, bench, make-model, tokenize, render-chat, ...).
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <iostream>

#include "cli/command.h"
#include "core/error.h"

namespace relay::cli {

std::vector<Command>& commands() {
  static std::vector<Command> all;
  return all;
}

std::string default_model_dir() {
  namespace fs = std::filesystem;
  // Next to the binary first (an install), then the source tree it was built from.
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    for (const fs::path& p : {exe.parent_path() / "models" / "relay-demo-moe",
                              exe.parent_path().parent_path() / "models" / "relay-demo-moe"}) {
      if (fs::exists(p / "config.json")) return p.string();
    }
  }
  return (fs::path(RELAY_SOURCE_DIR) / "models" / "relay-demo-moe").string();
}

}  // namespace relay::cli

int main(int argc, char** argv) {
  // NOTE: before any CUDA call. The ranks of a sharded CUDA backend run kernels that wait for each
  // other's (collectives); with lazy module loading, loading a kernel's module on first launch may
  // wait for the device to go idle, which such a waiting kernel never lets happen (the CUDA
  // programming guide's lazy-loading deadlock). Loading every module at start-up rules it out.
  setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);
  using namespace relay::cli;
  CLI::App app{"Relay: an inference server for Qwen mixture-of-experts models"};
  app.set_version_flag("--version",
                       relay::str("relay ", RELAY_VERSION, " (CUDA ", RELAY_HAVE_CUDA ? "on" : "off",
                                  RELAY_HAVE_CUDA ? relay::str(", architectures ", RELAY_CUDA_ARCHS) : "",
                                  ")"));
  app.require_subcommand(1);
  auto& cmds = commands();
  std::sort(cmds.begin(), cmds.end(), [](const Command& a, const Command& b) { return a.name < b.name; });
  std::function<int()> to_run;
  for (const Command& c : cmds) {
    CLI::App* sub = app.add_subcommand(c.name, c.description);
    auto run = std::make_shared<std::function<int()>>(c.setup(*sub));
    sub->callback([run, &to_run] { to_run = *run; });
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    return to_run();
  } catch (const relay::Error& e) {
    std::cerr << "relay: error: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "relay: error: " << e.what() << "\n";
    return 1;
  }
}
