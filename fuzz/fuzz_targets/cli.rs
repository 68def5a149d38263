//! The command line from arbitrary arguments: parsing and checking a run (bounds, launch shapes,
//! the processes the machine takes, the memory estimate) never panics, and a refusal is one
//! line.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|args: Vec<String>| {
    let argv = std::iter::once("kvshard".to_string()).chain(args.into_iter().take(16));
    if let Err((line, code)) = kvshard_cli::cli::parse(argv) {
        if code != 0 {
            assert!(!line.trim_end().contains('\n'), "a refusal of more than one line: {line}");
        }
    }
});
