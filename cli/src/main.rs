//! `kvshard`: the command line; everything it does lives in `kvshard_cli::cli`.

use std::process::ExitCode;

fn main() -> ExitCode {
    kvshard_cli::cli::main_with(std::env::args_os())
}
