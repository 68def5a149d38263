//! The pressure run's report, from the processes' messages.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use super::super::message::Message;
use super::super::Role;
use super::dcp::rows_of;
use super::PressurePdConfig;
use crate::demo::pressure::{PROMPT_1, PROMPT_2};
use crate::measure::{gbps, Ceiling, Moved};

/// Milliseconds since the Unix epoch: the processes of a run share the host's wall clock.
fn wall_ms(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

/// The fraction of `window` that `others` cover (each overlap counted once; they may overlap
/// each other, so this is an upper bound of the union, capped at 1).
fn covered(window: (f64, f64), others: &[(f64, f64)]) -> f64 {
    let len = window.1 - window.0;
    if len <= 0.0 {
        return 0.0;
    }
    let sum = others
        .iter()
        .map(|&(a, b)| (b.min(window.1) - a.max(window.0)).max(0.0))
        .fold(0.0, |x, y| x + y);
    (sum / len).min(1.0)
}

/// Milliseconds covered by at least one of `windows` (start, end).
fn union_ms(mut windows: Vec<(f64, f64)>) -> f64 {
    windows.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut total = 0.0;
    let mut open: Option<(f64, f64)> = None;
    for (a, b) in windows {
        open = match open {
            Some((s, e)) if a <= e => Some((s, e.max(b))),
            Some((s, e)) => {
                total += e - s;
                Some((a, b))
            }
            None => Some((a, b)),
        };
    }
    total + open.map_or(0.0, |(s, e)| e - s)
}

/// A rank's P/D of one prompt, as its message says.
struct PromptSend {
    rank: u32,
    request: u64,
    moved: Moved,
    window: (f64, f64),
    last_chunk: f64,
}

/// The run's tables; `shared_gpu` when the prefill ranks share a GPU (and its host link).
pub(super) fn table(
    cfg: &PressurePdConfig,
    messages: &[(Role, Message)],
    shared_gpu: bool,
) -> String {
    // Messages in rank (or decode) order, whatever order the pipes delivered them in.
    let mut messages: Vec<&(Role, Message)> = messages.iter().collect();
    messages.sort_by_key(|(role, _)| *role);
    let none = |what: &str| Ceiling {
        what: format!("no {what} measured"),
        gbps: 0.0,
        hardware: false,
    };
    let copy = messages
        .iter()
        .find_map(|(_, m)| match m {
            Message::Ceiling(c) => Some(c.clone()),
            _ => None,
        })
        .unwrap_or_else(|| none("copy ceiling"));
    let h2d = messages
        .iter()
        .find_map(|(_, m)| match m {
            Message::H2dCeiling(c) => Some(c.clone()),
            _ => None,
        })
        .unwrap_or_else(|| none("H2D ceiling"));
    let sends = prompt_sends(&messages);
    let mut out = String::new();
    sends_table(&mut out, cfg, &copy, &sends);
    reloads_table(&mut out, &h2d, &sends, &messages, shared_gpu);
    landed_table(&mut out, cfg, &messages, &sends);
    storage_table(&mut out, &messages);
    out
}

/// Each rank's P/D of each prompt, as the ranks' messages say.
fn prompt_sends(messages: &[&(Role, Message)]) -> Vec<PromptSend> {
    messages
        .iter()
        .filter_map(|(role, m)| match (role, m) {
            (
                Role::Rank(rank),
                Message::PromptSent {
                    request,
                    moved,
                    first,
                    last_chunk,
                    done,
                },
            ) => Some(PromptSend {
                rank: *rank,
                request: *request,
                moved: *moved,
                window: (wall_ms(*first), wall_ms(*done)),
                last_chunk: wall_ms(*last_chunk),
            }),
            _ => None,
        })
        .collect()
}

/// The decodes, as the report's first line names them.
fn decodes(cfg: &PressurePdConfig) -> String {
    if cfg.is_dcp() {
        format!(
            "{} decodes as DCP{} groups (I = {}, a process per decode rank)",
            cfg.decode_groups(),
            cfg.decode_layout.ranks(),
            cfg.decode_layout.interleave()
        )
    } else {
        format!("{} decodes", cfg.processes.decodes)
    }
}

/// The P/D table: each rank's sends of each prompt and all ranks' together, against the copy
/// ceiling `copy`.
fn sends_table(out: &mut String, cfg: &PressurePdConfig, copy: &Ceiling, sends: &[PromptSend]) {
    let sc = &cfg.scenario;
    let _ = writeln!(
        out,
        "{}: {} prefill ranks -> {}, two {}-token prompts (chunks of {}), a {}-token prefix reloaded from the host; sends: {}; all-gather: {}; ceiling: {copy}\n",
        sc.shape,
        sc.shape.ranks,
        decodes(cfg),
        sc.prompt_tokens,
        sc.chunk,
        sc.prefix_tokens,
        cfg.method,
        if cfg.nccl { "NCCL" } else { "host shared memory" },
    );
    let _ = writeln!(
        out,
        "| prompt | rank | P/D bytes (all decodes) | ms on the rank's stream | GB/s | % of ceiling |"
    );
    let _ = writeln!(out, "|---:|---|---:|---:|---:|---:|");
    for request in [PROMPT_1, PROMPT_2] {
        let of: Vec<&PromptSend> = sends.iter().filter(|s| s.request == request).collect();
        for s in &of {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {:.2} | {:.1} | {} |",
                request - 1,
                s.rank,
                s.moved.bytes,
                s.moved.ms,
                s.moved.gbps(),
                copy.share(s.moved.gbps())
            );
        }
        // Ranks on GPUs of their own send at once (bytes over the slowest rank); ranks that
        // share a GPU time-slice it without MPS (bytes over the sum of their times).
        let bytes: u64 = of.iter().map(|s| s.moved.bytes).sum();
        let slowest = of.iter().map(|s| s.moved.ms).fold(0.0, f64::max);
        let serial: f64 = of.iter().map(|s| s.moved.ms).sum();
        for (what, ms) in [
            ("all, concurrent (bytes / slowest rank)", slowest),
            ("all, serialized (bytes / sum of the ranks' times)", serial),
        ] {
            let g = gbps(bytes, ms);
            let _ = writeln!(
                out,
                "| {} | {what} | {bytes} | {ms:.2} | {g:.1} | {} |",
                request - 1,
                copy.share(g)
            );
        }
    }
}

/// The reload table: each rank's prefix reload against the H2D ceiling `h2d`, and how much of
/// it overlapped the other ranks' sends and reloads.
fn reloads_table(
    out: &mut String,
    h2d: &Ceiling,
    sends: &[PromptSend],
    messages: &[&(Role, Message)],
    shared_gpu: bool,
) {
    let reloads: Vec<(u32, Moved, (f64, f64))> = messages
        .iter()
        .filter_map(|(role, m)| match (role, m) {
            (Role::Rank(rank), Message::Reloaded { moved, start, end }) => {
                Some((*rank, *moved, (wall_ms(*start), wall_ms(*end))))
            }
            _ => None,
        })
        .collect();
    let _ = writeln!(
        out,
        "\npinned H2D ceiling (this run): {h2d}\n\n| rank | prefix reload H2D bytes | ms | GB/s | % of the H2D ceiling | share of the reload during other ranks' P/D sends | during other ranks' reloads |"
    );
    let _ = writeln!(out, "|---:|---:|---:|---:|---:|---:|---:|");
    // The share of a rank's reload window that other ranks' windows cover.
    let during = |rank: u32, window: (f64, f64), windows: &[(u32, (f64, f64))]| {
        let others: Vec<(f64, f64)> = windows
            .iter()
            .filter(|(r, _)| *r != rank)
            .map(|&(_, w)| w)
            .collect();
        if others.is_empty() {
            "n/a (one rank)".to_string()
        } else {
            format!("{:.0}%", 100.0 * covered(window, &others))
        }
    };
    let send_windows: Vec<(u32, (f64, f64))> = sends.iter().map(|s| (s.rank, s.window)).collect();
    let reload_windows: Vec<(u32, (f64, f64))> = reloads.iter().map(|r| (r.0, r.2)).collect();
    for &(rank, moved, window) in &reloads {
        let _ = writeln!(
            out,
            "| {rank} | {} | {:.2} | {:.1} | {} | {} | {} |",
            moved.bytes,
            moved.ms,
            moved.gbps(),
            h2d.share(moved.gbps()),
            during(rank, window, &send_windows),
            during(rank, window, &reload_windows),
        );
    }
    // Ranks that share a GPU share its host link: their reloads together are what the link
    // delivered, bytes over the time some reload was running (the union of the wall-clock
    // windows: reloads apart in time do not count the gap between them).
    if reloads.len() > 1 && shared_gpu {
        let bytes: u64 = reloads.iter().map(|r| r.1.bytes).sum();
        let busy = union_ms(reload_windows.iter().map(|&(_, w)| w).collect());
        let g = gbps(bytes, busy);
        let _ = writeln!(
            out,
            "| all, one shared link (bytes / union of the windows) | {bytes} | {busy:.2} | {g:.1} | {} | | |",
            h2d.share(g)
        );
    }
}

/// The decodes' table: what landed on each, and when against the last prefill chunk.
fn landed_table(
    out: &mut String,
    cfg: &PressurePdConfig,
    messages: &[&(Role, Message)],
    sends: &[PromptSend],
) {
    if cfg.is_dcp() {
        let _ = writeln!(
            out,
            "\n| prompt | decode | DCP rank | rows | bytes landed | last prefill chunk written -> decode complete (ms) | verified against the unsharded reference re-laid out |"
        );
        let _ = writeln!(out, "|---:|---:|---:|---:|---:|---:|---|");
    } else {
        let _ = writeln!(
            out,
            "\n| prompt | decode | bytes landed | last prefill chunk written -> decode complete (ms) | verified against the unsharded reference |"
        );
        let _ = writeln!(out, "|---:|---:|---:|---:|---|");
    }
    let mut landed: Vec<(u64, u32, u64, SystemTime)> = messages
        .iter()
        .filter_map(|(role, m)| match (role, m) {
            (
                Role::Decode(decode),
                Message::Landed {
                    request,
                    bytes,
                    done,
                },
            ) => Some((*request, *decode, *bytes, *done)),
            _ => None,
        })
        .collect();
    landed.sort_by_key(|&(request, decode, ..)| (request, decode));
    for (request, decode, bytes, done) in landed {
        let last_chunk = sends
            .iter()
            .filter(|s| s.request == request)
            .map(|s| s.last_chunk)
            .fold(0.0, f64::max);
        // A decode reports a prompt only once every block (or row) of it equals the
        // reference's.
        let m = cfg.decode_layout.ranks();
        let decode = if cfg.is_dcp() {
            let rank = decode % m;
            format!("{} | {rank} | {}", decode / m, rows_of(cfg, rank))
        } else {
            decode.to_string()
        };
        let _ = writeln!(
            out,
            "| {} | {decode} | {bytes} | {:.2} | byte-identical |",
            request - 1,
            wall_ms(done) - last_chunk,
        );
    }
}

/// The storage step's table, as each rank reported it.
fn storage_table(out: &mut String, messages: &[&(Role, Message)]) {
    let storage: Vec<(u32, &String)> = messages
        .iter()
        .filter_map(|(role, m)| match (role, m) {
            (Role::Rank(rank), Message::Storage { lines }) => {
                Some(lines.iter().map(move |l| (*rank, l)))
            }
            _ => None,
        })
        .flatten()
        .collect();
    if !storage.is_empty() {
        let _ = writeln!(
            out,
            "\n| rank | storage step (the prefix L2 -> L3 -> L2 -> L1, then L3 into a CP group of twice the size) |"
        );
        let _ = writeln!(out, "|---:|---|");
        for (rank, line) in storage {
            let _ = writeln!(out, "| {rank} | {} |", line.trim_start_matches("storage: "));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::scenario::Platform;

    use super::*;

    #[test]
    fn the_union_of_windows_leaves_out_the_gaps_between_them() {
        assert_eq!(union_ms(vec![(10.0, 12.0), (0.0, 2.0), (1.0, 3.0)]), 5.0);
        assert_eq!(union_ms(vec![(0.0, 10.0), (2.0, 3.0)]), 10.0);
        assert_eq!(union_ms(Vec::new()), 0.0);
    }

    #[test]
    fn the_reload_overlap_is_the_covered_share_of_its_window() {
        assert_eq!(covered((0.0, 10.0), &[]), 0.0);
        assert_eq!(covered((0.0, 10.0), &[(5.0, 20.0)]), 0.5);
        assert_eq!(covered((0.0, 10.0), &[(-5.0, 20.0), (2.0, 3.0)]), 1.0);
        assert_eq!(covered((4.0, 4.0), &[(0.0, 9.0)]), 0.0);
    }

    #[test]
    fn the_report_reads_every_message_of_the_run() {
        let cfg = PressurePdConfig::default_for(Platform::Gpu);
        let t = UNIX_EPOCH + Duration::from_secs(1_000);
        let ms = |n: u64| t + Duration::from_millis(n);
        let moved = |bytes, ms| Moved { bytes, ms };
        let mut messages = vec![
            (
                Role::Decode(0),
                Message::Ceiling(Ceiling {
                    what: "local D2D copy on GPU 0, 1 GiB".into(),
                    gbps: 2000.0,
                    hardware: true,
                }),
            ),
            (
                Role::Decode(0),
                Message::H2dCeiling(Ceiling {
                    what: "pinned H2D".into(),
                    gbps: 50.0,
                    hardware: true,
                }),
            ),
        ];
        for (rank, start) in [(0, 0), (1, 5)] {
            messages.push((
                Role::Rank(rank),
                Message::Reloaded {
                    moved: moved(25_000_000, 1.0),
                    start: ms(start),
                    end: ms(start + 10),
                },
            ));
            for request in [PROMPT_1, PROMPT_2] {
                messages.push((
                    Role::Rank(rank),
                    Message::PromptSent {
                        request,
                        moved: moved(1_000_000_000, 1.0 + f64::from(rank)),
                        first: ms(0),
                        last_chunk: ms(20),
                        done: ms(30),
                    },
                ));
            }
        }
        for decode in [0, 1] {
            for request in [PROMPT_1, PROMPT_2] {
                messages.push((
                    Role::Decode(decode),
                    Message::Landed {
                        request,
                        bytes: 2_000_000_000,
                        done: ms(32),
                    },
                ));
            }
        }
        // The order the pipes deliver does not matter.
        messages.reverse();
        let table = table(&cfg, &messages, true);
        assert!(
            table.contains("ceiling: local D2D copy on GPU 0, 1 GiB: 2000.0 GB/s"),
            "{table}"
        );
        // Rank 1 moved 1 GB in 2 ms: 500 GB/s, a quarter of the copy ceiling.
        assert!(
            table.contains("| 1 | 1 | 1000000000 | 2.00 | 500.0 | 25% |"),
            "{table}"
        );
        assert!(
            table.contains(
                "| 1 | all, concurrent (bytes / slowest rank) | 2000000000 | 2.00 | 1000.0 | 50% |"
            ),
            "{table}"
        );
        // Each reload: 25 GB/s, half the H2D ceiling; rank 0's window (0-10 ms) lies inside
        // rank 1's sends and half inside rank 1's reload (5-15 ms).
        assert!(
            table.contains("| 0 | 25000000 | 1.00 | 25.0 | 50% | 100% | 50% |"),
            "{table}"
        );
        // Together, over the union of both windows (0-15 ms): 50 MB in 15 ms on the one link.
        assert!(
            table.contains(
                "| all, one shared link (bytes / union of the windows) | 50000000 | 15.00 | 3.3 | 7% | | |"
            ),
            "{table}"
        );
        assert!(!super::table(&cfg, &messages, false).contains("one shared link"));
        assert_eq!(table.matches("| byte-identical |").count(), 4, "{table}");
        // 12 ms after the last chunk was written, decode 1 had prompt 1.
        assert!(
            table.contains("| 1 | 1 | 2000000000 | 12.00 | byte-identical |"),
            "{table}"
        );
    }
}
