//! The `lora-train` binary: parse the command line, run the command, map failures to exit
//! codes (src/commands/).

// Output goes through lora_train::util::out (outln!, errln!), which never panics.
#![warn(clippy::print_stdout, clippy::print_stderr)]

mod commands;

fn main() -> std::process::ExitCode {
    lora_train::util::out::direct();
    lora_train::parallel::prepare_process();
    let cli = commands::parse();
    commands::finish(commands::run(cli))
}
