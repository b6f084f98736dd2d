// What `megamoe` says to a mistyped command line: the unknown subcommand or option is named
// (with the closest valid name where one is close), the valid subcommands are listed, and
// the exit status is 1, whatever required option the command line also lacks.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "store_support.h"

namespace megamoe {
namespace {

using test::run_cli;

void expect_error(const std::string& args, const std::vector<std::string>& wanted) {
  const auto r = run_cli(args);
  EXPECT_EQ(r.status, 1) << args << ": " << r.output;
  EXPECT_NE(r.output.find("megamoe: error: "), std::string::npos) << args << ": " << r.output;
  for (const auto& w : wanted)
    EXPECT_NE(r.output.find(w), std::string::npos) << args << ": no '" << w << "' in\n" << r.output;
}

TEST(CliUsage, UnknownSubcommandIsNamedAndTheValidOnesListed) {
  expect_error("frobnicate", {"unknown subcommand 'frobnicate'", "the subcommands are: ", "demo", "forward",
                              "make-checkpoint", "inspect", "doctor"});
  expect_error("frobnicate --checkpoint x", {"unknown subcommand 'frobnicate'"});
  // A near miss names the subcommand meant.
  expect_error("forwrd --checkpoint x", {"unknown subcommand 'forwrd' (did you mean forward?)"});
  expect_error("inspcet x", {"(did you mean inspect?)"});
}

TEST(CliUsage, MissingSubcommandListsThem) {
  expect_error("", {"a subcommand is required, one of: ", "demo", "reload-check", "doctor"});
}

TEST(CliUsage, UnknownOptionIsNamedBeforeAMissingRequiredOne) {
  // --checkpoint is required by forward: the typo is what is reported, not the requirement.
  expect_error("forward --chekpoint /tmp/ck --layer 3 --input x --output y",
               {"unknown option --chekpoint for `megamoe forward` (did you mean --checkpoint?)"});
  expect_error("forward --checkpoint=/tmp/ck --layr=3 --input x --output y",
               {"unknown option --layr", "--layer?"});
  expect_error("demo --tokns 4", {"unknown option --tokns for `megamoe demo` (did you mean --tokens?)"});
  // Nothing close: named, no guess.
  {
    const auto r = run_cli("demo --frobnicate-everything");
    EXPECT_EQ(r.status, 1) << r.output;
    EXPECT_NE(r.output.find("unknown option --frobnicate-everything for `megamoe demo`"), std::string::npos)
        << r.output;
    EXPECT_EQ(r.output.find("did you mean"), std::string::npos) << r.output;
  }
  expect_error("--chekpoint x forward", {"unknown option --chekpoint before the subcommand"});
}

TEST(CliUsage, ValidCommandLinesStillParse) {
  // --help at either level, an option given with '=', and values after `--` are CLI11's.
  for (const char* args : {"--help", "forward --help", "demo -h", "make-checkpoint --help"}) {
    const auto r = run_cli(args);
    EXPECT_EQ(r.status, 0) << args << ": " << r.output;
    EXPECT_NE(r.output.find("Usage:"), std::string::npos) << args << ": " << r.output;
  }
  // A value error is still reported by CLI11, naming its option.
  const auto r = run_cli("demo --backend cpu --tokens=abc");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("--tokens"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace megamoe
