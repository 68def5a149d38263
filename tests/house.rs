//! The house's rules that read the sources, beside tests/layering.rs (imports and names):
//! a call that can block the host is named `_sync` (or is `synchronize`) and every `_sync` call
//! can block (docs/design.md, "Blocking calls"); files and functions stay short enough to read
//! (docs/design.md, "Files by job").

mod common;

use std::fs;

use common::source::{blanked, files, functions, python_functions, root, without_tests, Function};

/// What blocks the calling thread, as it reads in a function's body: a `_sync` call (of
/// kvshard, cudarc or the storage tier), a stream's or event's `synchronize`, the CPU twin's
/// counted host wait, the CUDA driver's synchronizations, a sleep, a channel's blocking
/// receive, a condition variable's wait and a thread's join.
const WAITS: &[&str] = &[
    "_sync(",
    ".synchronize(",
    "Synchronize(",
    "sleep(",
    ".recv()",
    ".recv_timeout(",
    ".wait_timeout",
    ".join()",
    ".sync_all(",
    ".sync_data(",
    "event::poll(",
];

/// Whether `name` says it blocks.
fn named_blocking(name: &str) -> bool {
    name.ends_with("_sync") || name == "synchronize"
}

/// The first wait `body` makes, if any.
fn wait_in(body: &str) -> Option<&'static str> {
    WAITS.iter().copied().find(|w| body.contains(w))
}

/// Who may call a function that waits without saying so.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Callers {
    /// Only functions named `_sync` (or listed here): it is their wait.
    Sync,
    /// Any: the reason says why the wait is not the caller's to name.
    Any,
}

/// The functions of `src/` that wait but are not named `_sync`, each with why, keyed by the
/// file (from `src/`) and the function's name. Every entry must still wait (a stale entry
/// fails), and callers of a [`Callers::Sync`] entry in its file must be named `_sync`.
const WAITING_HELPERS: &[(&str, &str, Callers, &str)] = &[
    ("backend/cpu/cpu_backend.rs", "drain", Callers::Sync,
     "the CPU twin's wait for one stream, counted: the body of write_sync, read_sync, synchronize"),
    ("hicache/controller.rs", "pop_completed", Callers::Sync,
     "the wait of ack_backups_sync and ack_loads_sync"),
    ("gpu/memory.rs", "new", Callers::Any,
     "cudarc's malloc_sync is plain cuMemAlloc (not stream-ordered): it waits for no stream"),
    ("gpu/memory.rs", "allocate", Callers::Any,
     "waits (release_sync) only where the device or host is full: the reuse cache goes back \
      to the driver before the allocation is refused"),
    ("gpu/mempool.rs", "alloc", Callers::Any,
     "waits on the pool's own stream, which holds this allocation alone (design.md)"),
    ("gpu/reaper.rs", "run", Callers::Any, "the reaper thread's own loop"),
    ("gpu/reaper.rs", "wait_idle", Callers::Any, "the wait of backend::wait_for_frees_sync"),
    ("gpu/reaper.rs", "stop_at_exit", Callers::Any,
     "an atexit handler: process exit waits (at most 500 ms) for the reaper's driver call"),
    ("ipc/link.rs", "poll", Callers::Any,
     "poll(2) bounded by its `wait`: the receives that take a timeout (design.md)"),
    ("ipc/channel.rs", "heartbeat_loop", Callers::Any, "the heartbeat thread's own loop"),
    ("ipc/channel.rs", "drop", Callers::Any,
     "joins the heartbeat thread, woken to stop at once"),
    ("ipc/channel.rs", "connect", Callers::Any,
     "meets a peer, bounded by its `wait` argument (design.md: connections take their bound)"),
    ("ipc/group.rs", "wait_until", Callers::Any,
     "the wait of barrier_sync and nccl_id_sync, and of GroupMemory::join (a connection)"),
    ("pool/host/backing.rs", "new_numa_local", Callers::Any,
     "joins the thread it allocates the pinned pool on (set-up; waits for no stream)"),
    ("transfer/endpoint/prefill.rs", "report_landed", Callers::Any,
     "waits only when told to: from poll_sync (with a timeout) and bye_sync"),
    ("transfer/endpoint/prefill.rs", "drain_inflight", Callers::Any,
     "from bye_sync, and from a failed endpoint's close: its copies land before its pools unmap"),
    ("transfer/nixl/target.rs", "fail_rank", Callers::Any,
     "a failed rank's bounce scatters run before its slots go: from rank_gone_sync, connect"),
    ("hicache/storage_stage.rs", "new", Callers::Any,
     "the storage worker thread's body, spawned here, calls the store's _sync calls"),
    ("hicache/storage_stage.rs", "drop", Callers::Any,
     "joins the storage worker after the jobs queued (each bounded by the store's deadline)"),
    ("pool/disk/gds.rs", "probe_once", Callers::Any,
     "the GDS driver's probe, once per process, bounded by its open timeout"),
    ("pool/disk/gds.rs", "wait", Callers::Any, "polls a request to a deadline: ceiling_sync's"),
    ("pool/disk/gds.rs", "measure", Callers::Any, "ceiling_sync's measurement"),
    ("pool/disk/store/open.rs", "open", Callers::Any,
     "DiskStore's constructor zero-fills a new file once (set-up)"),
    ("pool/disk/journal/writer.rs", "open", Callers::Any,
     "the journal's constructor writes and flushes a new header once (set-up)"),
    ("pool/disk/store.rs", "settle", Callers::Any, "the storage I/O of store_sync and load_sync"),
    ("pool/disk/store/storing.rs", "write_all", Callers::Any, "the storage I/O of store_sync"),
    ("pool/disk/store/load.rs", "check_and_unpack", Callers::Sync,
     "joins its scoped threads, which check and unpack pages already read: load_sync's CPU work"),
];

/// Whether `body` calls `name` (as a function or a method).
fn calls(body: &str, name: &str) -> bool {
    let call = format!("{name}(");
    body.match_indices(&call).any(|(at, _)| {
        let before = body[..at].chars().next_back();
        !before.is_some_and(|c| c.is_alphanumeric() || c == '_')
    })
}

/// Every function with a body in `src/`, test items left out, by file (from `src/`).
fn src_functions() -> Vec<(String, Function)> {
    let src = root().join("src");
    let mut out = Vec::new();
    for path in files(&src, ".rs") {
        let text = fs::read_to_string(&path).expect("a readable source");
        let rel = path.strip_prefix(&src).expect("under src");
        let rel = rel.to_string_lossy().into_owned();
        for f in functions(&without_tests(&blanked(&text))) {
            out.push((rel.clone(), f));
        }
    }
    out
}

#[test]
fn every_call_that_can_block_is_named_sync_and_every_sync_call_can() {
    let fns = src_functions();
    let helper = |file: &str, name: &str| {
        WAITING_HELPERS
            .iter()
            .find(|(f, n, _, _)| *f == file && *n == name)
    };
    // The names of what waits, directly or through what it calls (by name: a `_sync` call
    // counts as blocking when any function of its callees' names waits).
    let mut waiting: Vec<&str> = fns
        .iter()
        .filter(|(_, f)| wait_in(&f.body).is_some())
        .map(|(_, f)| f.name.as_str())
        .collect();
    loop {
        let more: Vec<&str> = fns
            .iter()
            .filter(|(_, f)| !waiting.contains(&f.name.as_str()))
            .filter(|(_, f)| waiting.iter().any(|w| calls(&f.body, w)))
            .map(|(_, f)| f.name.as_str())
            .collect();
        if more.is_empty() {
            break;
        }
        waiting.extend(more);
    }
    let mut wrong = Vec::new();
    for (file, f) in &fns {
        let wait = wait_in(&f.body);
        let reaches = waiting.iter().any(|w| calls(&f.body, w));
        match (wait, named_blocking(&f.name)) {
            (Some(w), false) if helper(file, &f.name).is_none() => wrong.push(format!(
                "src/{file}:{} `{}` waits (`{w}`) but is not named _sync: rename it, or list it \
                 in WAITING_HELPERS with why",
                f.line, f.name
            )),
            (None, true) if f.public && !reaches => wrong.push(format!(
                "src/{file}:{} `{}` is named _sync but waits for nothing: drop the marker",
                f.line, f.name
            )),
            _ => {}
        }
    }
    for &(file, name, callers, _) in WAITING_HELPERS {
        let in_file: Vec<_> = fns.iter().filter(|(f, _)| f == file).collect();
        if !in_file
            .iter()
            .any(|(_, f)| f.name == name && wait_in(&f.body).is_some())
        {
            wrong.push(format!(
                "src/{file} `{name}` is listed but no longer waits: unlist it"
            ));
        }
        if callers == Callers::Sync {
            for (_, f) in in_file {
                if f.name != name
                    && calls(&f.body, name)
                    && !named_blocking(&f.name)
                    && helper(file, &f.name).is_none()
                {
                    wrong.push(format!(
                        "src/{file}:{} `{}` calls `{name}`, which waits, but is not named _sync",
                        f.line, f.name
                    ));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "blocking calls:\n{}", wrong.join("\n"));
}

#[test]
fn the_wait_check_sees_waits_and_names() {
    // The check itself: a wait is seen in a body, a name with the marker is blocking, a call is
    // told from a longer name that ends alike.
    let code = blanked("pub fn a() { b.synchronize()?; } fn c() { \"x.join()\"; }");
    let fns = functions(&code);
    assert_eq!(wait_in(&fns[0].body), Some(".synchronize("));
    assert_eq!(
        wait_in(&fns[1].body),
        None,
        "a wait inside a string is no wait"
    );
    assert!(named_blocking("read_sync") && named_blocking("synchronize"));
    assert!(!named_blocking("sync_counts"));
    assert!(calls("{ self.drain()?; }", "drain") && !calls("{ x.undrain(); }", "drain"));
}

/// Most lines a file may have.
const FILE_LINES: usize = 800;
/// Most lines a function may have, from its `fn` (or `def`) to its end.
const FUNCTION_LINES: usize = 120;

/// The folders held to the lengths, from the repository's root, and the files of them.
const SHORT: &[(&str, &[&str])] = &[
    ("src", &[".rs"]),
    ("cli/src", &[".rs"]),
    ("cli/benches", &[".rs"]),
    ("python/src", &[".rs"]),
    ("python/kvshard", &[".py", ".pyi"]),
];

/// Paths (from the root; a folder ends in `/`) not held to the lengths, or `path:function`
/// for one function, each with why. Keep this short: split a file by job, a function by step.
const LONG: &[(&str, &str)] = &[(
    "python/kvshard/_kvshard.pyi",
    "the extension's whole typed surface in the one stub file stubtest and mypy read",
)];

#[test]
fn no_file_over_800_lines_and_no_function_over_120() {
    let mut wrong = Vec::new();
    let mut listed_used = vec![false; LONG.len()];
    for (dir, exts) in SHORT {
        for ext in *exts {
            for path in files(&root().join(dir), ext) {
                let rel = path.strip_prefix(root()).expect("under the root");
                let rel = rel.to_string_lossy().into_owned();
                if let Some(k) = LONG
                    .iter()
                    .position(|(p, _)| !p.contains(':') && rel.starts_with(p))
                {
                    listed_used[k] = true;
                    continue;
                }
                let text = fs::read_to_string(&path).expect("a readable source");
                let lines = text.lines().count();
                if lines > FILE_LINES {
                    wrong.push(format!("{rel}: {lines} lines (at most {FILE_LINES})"));
                }
                let long: Vec<(String, usize, usize)> = if *ext == ".rs" {
                    functions(&blanked(&text))
                        .into_iter()
                        .map(|f| (f.name, f.line, f.lines))
                        .collect()
                } else {
                    python_functions(&text)
                };
                for (name, line, n) in long {
                    let listed = LONG.iter().position(|(p, _)| *p == format!("{rel}:{name}"));
                    if let (Some(k), true) = (listed, n > FUNCTION_LINES) {
                        listed_used[k] = true;
                    }
                    if n > FUNCTION_LINES && listed.is_none() {
                        wrong.push(format!(
                            "{rel}:{line} `{name}`: {n} lines (at most {FUNCTION_LINES})"
                        ));
                    }
                }
            }
        }
    }
    for (k, (path, _)) in LONG.iter().enumerate() {
        if !listed_used[k] {
            wrong.push(format!(
                "{path} is listed as long but is gone or short: unlist it"
            ));
        }
    }
    assert!(wrong.is_empty(), "too long:\n{}", wrong.join("\n"));
}

#[test]
fn the_length_check_counts_a_function_to_its_end() {
    let rust = functions(&blanked("fn a() {\n    let s = \"}\";\n}\nfn b();\n"));
    assert_eq!(
        (rust.len(), rust[0].lines),
        (1, 3),
        "a brace in a string ends nothing"
    );
    let python = python_functions("def f(x):\n    y = (\n  1)\n    return y\n\nz = 1\n");
    assert_eq!(python, vec![("f".to_string(), 1, 4)]);
}
