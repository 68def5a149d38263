//! `kvshard`: the command line; everything it does lives in `kvshard::cli`.

use std::process::ExitCode;

fn main() -> ExitCode {
    kvshard::cli::main_with(std::env::args_os())
}
