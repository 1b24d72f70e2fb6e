// The shardckpt command-line tool: plan, demo, load, verify, reshard, inspect, adopt (docs/cli.md).
#include <CLI/CLI.hpp>
#ifdef SHARDCKPT_HAVE_MPI
#include <mpi.h>
#endif

#include <sys/resource.h>

#include <cstring>
#include <exception>
#include <iostream>
#include <map>
#include <string>
#include <string_view>
import shardckpt;
import shardckpt.cli;

namespace cli = shardckpt::cli;

namespace {

// The first word that is not a flag must name a command: say so plainly when it does not (CLI11
// would only say that a subcommand is required).
bool known_command(int argc, char** argv, const CLI::App& app) {
  for (int i = 1; i < argc; ++i) {
    if (argv[i][0] == '-') continue;
    for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
      if (sub->get_name() == argv[i]) return true;
    std::cerr << "shardckpt: error: unknown command '" << argv[i]
              << "' (commands: plan, demo, load, verify, reshard, inspect, adopt; see shardckpt --help)\n";
    return false;
  }
  return true;
}

bool wants_mpi(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--mpi") == 0) return true;
  return false;
}

// Thread ranks each hold a few descriptors: the soft limit on them rises to the hard one.
void raise_descriptor_limit() {
  struct rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    (void)::setrlimit(RLIMIT_NOFILE, &rl);
  }
}

}  // namespace

int main(int argc, char** argv) {
  // Before anything is opened: a closed standard stream must not become the checkpoint's descriptor.
  shardckpt::io::ensure_standard_descriptors();
  raise_descriptor_limit();
#ifdef SHARDCKPT_HAVE_MPI
  const bool mpi = wants_mpi(argc, argv);
  // Async saves run collectives on a thread of their own.
  int provided = 0;
  if (mpi) MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
#else
  (void)wants_mpi;
#endif
  CLI::App app{"shardckpt: save and load GTP-sharded tensor-parallel weights as HDF5 without gathering"};
  app.set_version_flag("--version", std::string("shardckpt ") + std::string(shardckpt::library_version()) + " (checkpoint format " +
                                        std::to_string(shardckpt::format_version) + ")");
  app.require_subcommand(1);
  app.fallthrough();
  app.failure_message(
      [](const CLI::App*, const CLI::Error& e) { return std::string("shardckpt: error: ") + e.what() + "\n"; });
  cli::Global global;
  app.add_flag("-q,--quiet", global.quiet, "no progress line on standard error");
  std::map<std::string, cli::Runner> runners{{"plan", cli::add_plan(app, global)},
                                             {"demo", cli::add_demo(app, global)},
                                             {"load", cli::add_load(app, global)},
                                             {"verify", cli::add_verify(app, global)},
                                             {"reshard", cli::add_reshard(app, global)},
                                             {"inspect", cli::add_inspect(app, global)},
                                             {"adopt", cli::add_adopt(app, global)}};
  int rc = cli::success;
  try {
    if (!known_command(argc, argv, app)) {
      rc = cli::failure;
    } else {
      app.parse(argc, argv);
      for (const auto& [name, run] : runners)
        if (app.got_subcommand(name)) rc = run();
    }
  } catch (const CLI::ParseError& e) {
    rc = app.exit(e) == 0 ? cli::success : cli::failure;  // --help and --version are no error
  } catch (const std::exception& e) {
    rc = cli::report_error(e);
  }
#ifdef SHARDCKPT_HAVE_MPI
  if (mpi) {
    // A failing rank takes the whole job down at once instead of leaving the others waiting.
    if (rc == cli::failure) MPI_Abort(MPI_COMM_WORLD, rc);
    MPI_Finalize();
  }
#endif
  return rc;
}
