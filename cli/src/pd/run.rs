//! A run of processes: starts every role, forwards what they print, gathers their messages and
//! builds the transfer scenario's report.

use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvshard::{Error, Result};

use super::message::Message;
use super::{PdConfig, Role, REQUEST_TIMEOUT, STARTUP};
use crate::measure::{gbps, Ceiling};

/// A child process of the run, killed and reaped if the run ends before it does.
struct RoleProcess {
    role: Role,
    child: Child,
}

impl Drop for RoleProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits for every process; the first that fails (or a run past its time, or a process that
/// sent what is no message, which `refused` holds) gets the others killed. Returns what failed.
fn wait_all(
    processes: &mut [(RoleProcess, std::thread::JoinHandle<()>)],
    refused: &Mutex<Vec<String>>,
) -> Vec<String> {
    let start = Instant::now();
    let limit = STARTUP + REQUEST_TIMEOUT * 4;
    let mut running: Vec<bool> = vec![true; processes.len()];
    let mut failures = Vec::new();
    while running.iter().any(|&r| r) {
        for (i, (p, _)) in processes.iter_mut().enumerate() {
            if !running[i] {
                continue;
            }
            match p.child.try_wait() {
                Ok(Some(status)) => {
                    running[i] = false;
                    if !status.success() {
                        failures.push(format!("{} exited with {status}", p.role));
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    running[i] = false;
                    failures.push(format!("{}: {e}", p.role));
                }
            }
        }
        failures.append(&mut refused.lock().unwrap_or_else(|p| p.into_inner()));
        if !failures.is_empty() || start.elapsed() > limit {
            if failures.is_empty() {
                failures.push(format!("still running after {limit:?}"));
            }
            for (p, _) in processes.iter_mut() {
                let _ = p.child.kill();
                let _ = p.child.wait();
            }
            return failures;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    failures
}

/// What a run measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    /// The table, in markdown.
    pub markdown: String,
}

/// The socket path of this run (`kind` tells the scenarios apart).
pub(crate) fn socket_path(kind: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("kvshard-{kind}-{}.sock", std::process::id()))
}

/// Runs `cfg`: starts the N prefill processes and the decode (`exe pd --role ...`), forwards
/// what they print, and builds the table from their messages.
pub fn run(cfg: &PdConfig, exe: &Path) -> Result<Report> {
    cfg.validate()?;
    let socket = socket_path("pd");
    let mut args = vec!["pd".to_string()];
    args.extend(cfg.to_args());
    args.push("--socket".into());
    args.push(socket.display().to_string());
    let roles = (0..cfg.shape.ranks)
        .map(Role::Rank)
        .chain([Role::Decode(0)])
        .collect();
    let messages = run_roles(exe, &args, roles);
    let _ = std::fs::remove_file(&socket);
    Ok(Report {
        markdown: table(cfg, &messages?),
    })
}

/// The hidden flags that make a process of the run play `role`.
fn role_args(role: Role) -> [String; 4] {
    let (kind, index) = match role {
        Role::Rank(r) => ("prefill", r),
        Role::Decode(d) => ("decode", d),
    };
    [
        "--role".into(),
        kind.into(),
        "--rank".into(),
        index.to_string(),
    ]
}

/// Starts `exe ARGS ROLE_ARGS` for every role of `roles`, forwards what they print (prefixed
/// with the role) and returns their messages with the role of the process that sent each, once
/// every process has exited; the first that fails, a line that is no message where one should
/// be, or a run past its time gets the others killed and fails the run.
pub(crate) fn run_roles(
    exe: &Path,
    args: &[String],
    roles: Vec<Role>,
) -> Result<Vec<(Role, Message)>> {
    let messages: Arc<Mutex<Vec<(Role, Message)>>> = Arc::default();
    let refused: Arc<Mutex<Vec<String>>> = Arc::default();
    let spawn = |role: Role| -> Result<(RoleProcess, std::thread::JoinHandle<()>)> {
        let mut child = Command::new(exe)
            .args(args)
            .args(role_args(role))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|source| Error::Os {
                call: "spawn a role process",
                source,
            })?;
        let stdout = child.stdout.take().ok_or_else(|| Error::Os {
            call: "pipe a role's output",
            source: std::io::Error::other("no stdout"),
        })?;
        let (sink, refused) = (messages.clone(), refused.clone());
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout)
                .lines()
                .map_while(std::io::Result::ok)
            {
                match Message::from_line(&line, role) {
                    Ok(Some(message)) => sink
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push((role, message)),
                    Ok(None) => println!("[{role}] {line}"),
                    Err(e) => refused
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(format!(
                            "{role} sent a message line that is none ({e}): {line}"
                        )),
                }
            }
        });
        Ok((RoleProcess { role, child }, reader))
    };
    let mut processes = Vec::with_capacity(roles.len());
    for role in roles {
        processes.push(spawn(role)?);
    }
    let mut failures = wait_all(&mut processes, &refused);
    for (_, reader) in processes {
        let _ = reader.join();
    }
    // A refusal read after the last process exited still fails the run.
    failures.append(&mut refused.lock().unwrap_or_else(|p| p.into_inner()));
    if !failures.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "pd run failed: {}",
            failures.join("; ")
        )));
    }
    let messages = std::mem::take(&mut *messages.lock().unwrap_or_else(|p| p.into_inner()));
    Ok(messages)
}

/// The report table from the processes' messages.
fn table(cfg: &PdConfig, messages: &[(Role, Message)]) -> String {
    let ceiling = messages
        .iter()
        .find_map(|(_, m)| match m {
            Message::Ceiling(c) => Some(c.clone()),
            _ => None,
        })
        .unwrap_or(Ceiling {
            what: "none measured".into(),
            gbps: 0.0,
            hardware: false,
        });
    let shared_gpu = cfg.processes.ranks_share_a_gpu(cfg.shape.ranks);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} prefill rank(s) -> decode, {}, chunks of {} pages, {} iteration(s) per case; ceiling: {ceiling}; on the ranks' streams: bytes / {}\n",
        cfg.shape.ranks,
        cfg.shape,
        cfg.chunk_pages,
        cfg.iterations,
        if shared_gpu {
            "the sum of the ranks' stream times (they share a device and take turns on it)"
        } else {
            "the slowest rank's stream time"
        }
    );
    let _ = writeln!(
        out,
        "| pages | method | GB/s end to end | GB/s on the ranks' streams | % of ceiling (streams) | launches / chunk | copy calls / chunk | descriptors / chunk | verified |"
    );
    let _ = writeln!(out, "|---:|---|---:|---:|---:|---:|---:|---:|---|");
    for (case, c) in cfg.cases().into_iter().enumerate() {
        let case = case as u32;
        // (iteration, wall ms, bytes, verified) of every request of the case that arrived.
        let received: Vec<(u32, f64, u64, bool)> = messages
            .iter()
            .filter_map(|(_, m)| match *m {
                Message::Received {
                    case: k,
                    iteration,
                    wall_ms,
                    bytes,
                    verified,
                } if k == case => Some((iteration, wall_ms, bytes, verified)),
                _ => None,
            })
            .collect();
        // (iteration, kernel ms, chunks, launches, copy calls, descriptors) of every rank's send.
        let sent: Vec<(u32, f64, [u64; 4])> = messages
            .iter()
            .filter_map(|(_, m)| match *m {
                Message::Sent {
                    case: k,
                    iteration,
                    kernel_ms,
                    chunks,
                    launches,
                    copy_calls,
                    descriptors,
                    ..
                } if k == case => Some((
                    iteration,
                    kernel_ms,
                    [chunks, launches, copy_calls, descriptors],
                )),
                _ => None,
            })
            .collect();
        // Best iteration end to end; on the streams, each iteration's slowest rank (ranks on
        // distinct GPUs run at once) or the sum of the ranks (ranks sharing a GPU take turns on
        // it, so each rank's events time only its own turn), best of those.
        let bytes = received.iter().map(|r| r.2).max().unwrap_or(0);
        let wall = received.iter().map(|r| r.1).fold(f64::MAX, f64::min);
        let stream = (0..cfg.iterations as u32)
            .map(|i| {
                let ranks = sent.iter().filter(|s| s.0 == i).map(|s| s.1);
                if shared_gpu {
                    ranks.sum()
                } else {
                    ranks.fold(0.0, f64::max)
                }
            })
            .filter(|&ms| ms > 0.0)
            .fold(f64::MAX, f64::min);
        // Per chunk, over every rank's first iteration.
        let per_chunk = |k: usize| {
            let first = sent.iter().filter(|s| s.0 == 0);
            let chunks: u64 = first.clone().map(|s| s.2[0]).sum();
            let total: u64 = first.map(|s| s.2[k]).sum();
            if chunks > 0 {
                total as f64 / chunks as f64
            } else {
                0.0
            }
        };
        let verified = received.iter().any(|r| r.3);
        let stream_gbps = gbps(bytes, stream);
        let _ = writeln!(
            out,
            "| {} | {} | {:.1} | {:.1} | {} | {:.1} | {:.1} | {:.1} | {} |",
            c.pages,
            c.method,
            gbps(bytes, wall),
            stream_gbps,
            ceiling.share(stream_gbps),
            per_chunk(1),
            per_chunk(2),
            per_chunk(3),
            if verified { "byte-identical" } else { "NO" },
        );
    }
    out
}
