//! The `lora-train` binary: parse the command line, run the command, map failures to exit
//! codes (src/commands/).

mod commands;

use clap::Parser;

fn main() -> std::process::ExitCode {
    lora_train::parallel::prepare_process();
    let cli = commands::Cli::parse();
    commands::finish(commands::run(cli))
}
