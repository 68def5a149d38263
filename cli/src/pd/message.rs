//! What the processes of a `kvshard pd` run tell the process that started them: typed
//! [`Message`]s, one per line of the child's stdout, so the rest of what a child prints (its
//! progress, its errors) goes on being forwarded as text.
//!
//! A message line is [`TAG`], a space, and the message's postcard encoding in hex: postcard is
//! compact and has a documented wire format, and hex keeps the frame one line with no byte a
//! line reader could split. The parent knows which process printed a line (its [`Role`]), so a
//! message never names its sender, and a message a process of that role never sends is refused
//! like one that does not decode: either fails the run.

use std::fmt;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use super::Role;
use crate::measure::{Ceiling, Moved};

/// What starts every message line.
pub const TAG: &str = "@pd";

/// A measurement one process of a run reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Message {
    /// The copy ceiling of the run (a decode measures it; the first, in the pressure scenario).
    Ceiling(Ceiling),
    /// The pinned host-to-device ceiling the pressure scenario's reloads are measured against
    /// (decode 0).
    H2dCeiling(Ceiling),
    /// Transfer scenario, a decode: one request arrived whole.
    Received {
        /// The request's case.
        case: u32,
        /// Its iteration.
        iteration: u32,
        /// Registration to completion, on the decode's clock.
        wall_ms: f64,
        /// Bytes that landed.
        bytes: u64,
        /// Whether the decode checked them block by block (the first iteration of a case).
        verified: bool,
    },
    /// Transfer scenario, a rank: what it did to send one request.
    Sent {
        /// The request's case.
        case: u32,
        /// Its iteration.
        iteration: u32,
        /// First chunk to last on the rank's stream (events).
        kernel_ms: f64,
        /// Chunks sent.
        chunks: u64,
        /// Kernel launches.
        launches: u64,
        /// Copy-engine calls.
        copy_calls: u64,
        /// Descriptors.
        descriptors: u64,
        /// Bytes this rank moved.
        bytes: u64,
    },
    /// Pressure scenario, a rank: its P/D of one prompt to every decode.
    PromptSent {
        /// The prompt's request id.
        request: u64,
        /// Bytes to every decode, and the device time of the sends on the rank's stream.
        moved: Moved,
        /// When the prompt's first send was enqueued.
        first: SystemTime,
        /// When its last chunk had been written.
        last_chunk: SystemTime,
        /// When its sends had completed.
        done: SystemTime,
    },
    /// Pressure scenario, a rank: the seeded prefix's reload from the host.
    Reloaded {
        /// Bytes loaded H2D and the device time.
        moved: Moved,
        /// When the reload started, on the wall clock the processes share.
        start: SystemTime,
        /// When it ended.
        end: SystemTime,
    },
    /// Pressure scenario, a rank: what its storage step reported (the prefix L2 -> L3 -> L2 ->
    /// L1, then from L3 into its reader ranks of a CP group of twice the size, each checked
    /// against the reference), or why it did not run.
    Storage {
        /// The step's lines.
        lines: Vec<String>,
    },
    /// Pressure scenario, a decode: one prompt landed, and every block of it equals the
    /// unsharded reference's.
    Landed {
        /// The prompt's request id.
        request: u64,
        /// Bytes that landed.
        bytes: u64,
        /// When the decode saw it complete.
        done: SystemTime,
    },
    /// Pressure scenario with decode context-parallel groups, rank 0 of a group: the group's
    /// registration of one prompt (a `transfer::DecodeRegistration`), which it writes to the
    /// group's registration socket for every prefill rank instead of printing it. Each decode
    /// rank's pool is the one that rank published on its control channel.
    DecodeRegistration {
        /// The prompt's request id.
        request: u64,
        /// The group's ranks (M).
        ranks: u32,
        /// Its interleave (I tokens).
        interleave: u32,
        /// Tokens of the prompt.
        tokens: u64,
        /// Pages of the prompt the group holds already (never sent).
        prefix_pages: u64,
        /// Per decode rank, in rank order: its pages of the prompt, from its first.
        pages: Vec<Vec<u64>>,
        /// Per decode rank: the pages of its indexer state.
        state_pages: Vec<Vec<u64>>,
    },
}

/// Why a line is no message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MessageError {
    /// Not hex after the tag (a non-hex digit, or an odd count).
    NotHex,
    /// The bytes are no [`Message`]: postcard's reason.
    Undecodable(String),
    /// Bytes left over after a whole message.
    Trailing(usize),
    /// A message a process of this role never sends.
    Unexpected {
        /// Who sent it.
        from: Role,
        /// Which message.
        message: &'static str,
    },
}

impl fmt::Display for MessageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MessageError::NotHex => f.write_str("not hex"),
            MessageError::Undecodable(why) => write!(f, "undecodable: {why}"),
            MessageError::Trailing(n) => write!(f, "{n} bytes after the message"),
            MessageError::Unexpected { from, message } => {
                write!(f, "{from} never sends {message}")
            }
        }
    }
}

impl std::error::Error for MessageError {}

impl Message {
    /// The message's kind, as errors name it.
    pub fn kind(&self) -> &'static str {
        match self {
            Message::Ceiling(_) => "Ceiling",
            Message::H2dCeiling(_) => "H2dCeiling",
            Message::Received { .. } => "Received",
            Message::Sent { .. } => "Sent",
            Message::PromptSent { .. } => "PromptSent",
            Message::Reloaded { .. } => "Reloaded",
            Message::Landed { .. } => "Landed",
            Message::Storage { .. } => "Storage",
            Message::DecodeRegistration { .. } => "DecodeRegistration",
        }
    }

    /// Whether a process of role `from` sends this message: ceilings and arrivals come from
    /// decodes, sends and reloads from ranks.
    pub fn sent_by(&self, from: Role) -> bool {
        match self {
            Message::Ceiling(_)
            | Message::H2dCeiling(_)
            | Message::Received { .. }
            | Message::Landed { .. }
            | Message::DecodeRegistration { .. } => matches!(from, Role::Decode(_)),
            Message::Sent { .. }
            | Message::PromptSent { .. }
            | Message::Reloaded { .. }
            | Message::Storage { .. } => matches!(from, Role::Rank(_)),
        }
    }

    /// The message's line (without the newline).
    pub fn to_line(&self) -> String {
        // A Vec sink and these plain types cannot fail to encode.
        let bytes = postcard::to_allocvec(self).unwrap_or_default();
        let mut line = String::with_capacity(TAG.len() + 1 + 2 * bytes.len());
        line.push_str(TAG);
        line.push(' ');
        for b in bytes {
            line.push(char::from(HEX[usize::from(b >> 4)]));
            line.push(char::from(HEX[usize::from(b & 15)]));
        }
        line
    }

    /// Prints the message's line on stdout, for the parent to read.
    pub fn emit(&self) {
        println!("{}", self.to_line());
    }

    /// The message of `line` printed by a process of role `from`: `Ok(None)` for a line that is
    /// not a message (text to forward), an error for a message line that does not decode whole
    /// or is not one `from` sends.
    pub fn from_line(line: &str, from: Role) -> Result<Option<Message>, MessageError> {
        let Some(rest) = line.strip_prefix(TAG) else {
            return Ok(None);
        };
        let Some(hex) = rest.strip_prefix(' ') else {
            // `@pdx...`: text that merely starts like a message.
            return Ok(None);
        };
        let hex = hex.trim_end();
        if hex.len() % 2 != 0 {
            return Err(MessageError::NotHex);
        }
        let bytes = hex
            .as_bytes()
            .chunks(2)
            .map(|pair| Some(nibble(pair[0])? << 4 | nibble(pair[1])?))
            .collect::<Option<Vec<u8>>>()
            .ok_or(MessageError::NotHex)?;
        let (message, rest) = postcard::take_from_bytes::<Message>(&bytes)
            .map_err(|e| MessageError::Undecodable(e.to_string()))?;
        if !rest.is_empty() {
            return Err(MessageError::Trailing(rest.len()));
        }
        if !message.sent_by(from) {
            return Err(MessageError::Unexpected {
                from,
                message: message.kind(),
            });
        }
        Ok(Some(message))
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn nibble(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

/// A prefill rank's times of one prompt's sends, reported as [`Message::PromptSent`] once they
/// have completed.
#[derive(Debug, Default)]
pub struct PromptTimes {
    first: Option<SystemTime>,
    last_chunk: Option<SystemTime>,
}

impl PromptTimes {
    /// Whether the prompt's first send has been enqueued.
    pub fn started(&self) -> bool {
        self.first.is_some()
    }

    /// The prompt's first send is being enqueued now.
    pub fn start(&mut self) {
        self.first = Some(SystemTime::now());
    }

    /// The prompt's last chunk has been written now.
    pub fn last_chunk_written(&mut self) {
        self.last_chunk = Some(SystemTime::now());
    }

    /// Emits the prompt's [`Message::PromptSent`], its sends complete now, and forgets the
    /// prompt (the next one starts afresh).
    pub fn emit_sent(&mut self, request: u64, moved: Moved) {
        let done = SystemTime::now();
        Message::PromptSent {
            request,
            moved,
            first: self.first.take().unwrap_or(done),
            last_chunk: self.last_chunk.take().unwrap_or(done),
            done,
        }
        .emit();
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;

    fn every_kind() -> Vec<(Role, Message)> {
        let t = UNIX_EPOCH + Duration::from_micros(1_733_000_000_123_456);
        let ceiling = Ceiling {
            what: "peer copy engine GPU 0 -> GPU 1, 1 GiB".into(),
            gbps: 397.5,
            hardware: true,
        };
        let moved = Moved {
            bytes: 1 << 33,
            ms: 21.25,
        };
        vec![
            (Role::Decode(0), Message::Ceiling(ceiling.clone())),
            (Role::Decode(0), Message::H2dCeiling(ceiling)),
            (
                Role::Decode(0),
                Message::Received {
                    case: 4,
                    iteration: 2,
                    wall_ms: 1.5,
                    bytes: u64::MAX,
                    verified: true,
                },
            ),
            (
                Role::Rank(3),
                Message::Sent {
                    case: 1,
                    iteration: 0,
                    kernel_ms: 0.25,
                    chunks: 7,
                    launches: 14,
                    copy_calls: 0,
                    descriptors: 99,
                    bytes: 123_456,
                },
            ),
            (
                Role::Rank(1),
                Message::PromptSent {
                    request: 2,
                    moved,
                    first: t,
                    last_chunk: t + Duration::from_millis(3),
                    done: t + Duration::from_millis(4),
                },
            ),
            (
                Role::Rank(0),
                Message::Reloaded {
                    moved,
                    start: t,
                    end: t + Duration::from_nanos(1),
                },
            ),
            (
                Role::Decode(2),
                Message::Landed {
                    request: 3,
                    bytes: 8,
                    done: t,
                },
            ),
            (
                Role::Rank(1),
                Message::Storage {
                    lines: vec!["storage: a line".into(), "storage: another".into()],
                },
            ),
            (
                Role::Decode(0),
                Message::DecodeRegistration {
                    request: 1,
                    ranks: 2,
                    interleave: 64,
                    tokens: 130,
                    prefix_pages: 0,
                    pages: vec![vec![2, 3], vec![2]],
                    state_pages: vec![vec![2, 3], vec![2]],
                },
            ),
        ]
    }

    #[test]
    fn every_message_comes_back_as_it_was_sent_on_one_line() {
        for (role, message) in every_kind() {
            let line = message.to_line();
            assert!(line.starts_with("@pd ") && !line.contains('\n'), "{line}");
            assert_eq!(
                Message::from_line(&line, role),
                Ok(Some(message.clone())),
                "{line}"
            );
            // A trailing carriage return or blank (a line read from a pipe) is no harm.
            assert_eq!(
                Message::from_line(&format!("{line}\r"), role),
                Ok(Some(message))
            );
        }
    }

    #[test]
    fn text_is_forwarded_and_garbage_after_the_tag_is_refused() {
        let role = Role::Rank(0);
        for text in [
            "",
            "seed: 4096 tokens",
            "pd: @pd inside",
            "@pdx 00",
            " @pd 00",
        ] {
            assert_eq!(Message::from_line(text, role), Ok(None), "{text:?}");
        }
        let line = every_kind()[3].1.to_line();
        assert_eq!(Message::from_line("@pd 0", role), Err(MessageError::NotHex));
        assert_eq!(
            Message::from_line("@pd zz", role),
            Err(MessageError::NotHex)
        );
        assert_eq!(
            Message::from_line(&line.to_uppercase().replace("@PD", "@pd"), role),
            Err(MessageError::NotHex),
            "lowercase hex only"
        );
        // The old `key=value` lines are no messages.
        assert_eq!(
            Message::from_line("@pd case=0 iter=0 kernel_ms=1.0", role),
            Err(MessageError::NotHex)
        );
        // Cut short, an unknown variant, bytes after a whole message.
        assert!(matches!(
            Message::from_line(&line[..line.len() - 2], role),
            Err(MessageError::Undecodable(_))
        ));
        assert!(matches!(
            Message::from_line("@pd 7f", role),
            Err(MessageError::Undecodable(_))
        ));
        assert_eq!(
            Message::from_line(&format!("{line}00ff"), role),
            Err(MessageError::Trailing(2))
        );
    }

    #[test]
    fn a_message_from_a_process_that_never_sends_it_is_refused() {
        for (role, message) in every_kind() {
            let other = match role {
                Role::Rank(r) => Role::Decode(r),
                Role::Decode(d) => Role::Rank(d),
            };
            let e = Message::from_line(&message.to_line(), other).unwrap_err();
            assert_eq!(
                e,
                MessageError::Unexpected {
                    from: other,
                    message: message.kind()
                }
            );
            assert!(e.to_string().contains(message.kind()), "{e}");
        }
    }
}
