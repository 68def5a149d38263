//! A process's state and start time, read from `/proc`: how the control channel tells a peer
//! that exited from one that is only slow.

/// State and start time of a process, from `/proc/<pid>/stat` (`None`: no such process): how a
/// peer that exited is told from one that is only slow, and from a new process that reused its
/// PID.
pub(crate) fn proc_stat(pid: i32) -> Option<(char, Option<u64>)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may contain anything: fields follow the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let start = fields.nth(18).and_then(|s| s.parse().ok());
    Some((state, start))
}
