//! What an [`Error`](super::Error) carries beside its message: the causes some variants hold
//! as typed values (why eviction stalled, how a peer broke the wire protocol, what a P/D
//! request's deadline found missing), and the protocol limits those name. They live here, at
//! the bottom of the crate, so the error type depends on nothing above it; the modules they
//! describe re-export them (`shard::EvictionStall`, `ipc::wire::ProtocolError`, `transfer::Overdue`).

use std::fmt;
use std::time::Duration;

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"KVSC";
/// Protocol version; every frame carries it and the handshake compares it. Version 2: `Register`
/// names its pool and lists the pages after the cached prefix, `ChunkDone` counts bytes per
/// component. Version 3: `Chunk` (was `ChunkDone`) carries the chunk's status as it is
/// (`transfer::ChunkStatus`).
pub const VERSION: u16 = 3;
/// Largest payload a frame may carry (1 MiB: a pool description of hundreds of layers is a few
/// KiB; the cap bounds what a misbehaving peer can make the receiver buffer).
pub const MAX_PAYLOAD_BYTES: usize = 1 << 20;
/// Most file descriptors one frame may carry.
pub const MAX_FDS: usize = 16;

/// What a peer sent that the protocol refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// The frame does not start with [`MAGIC`]: not a kvshard peer, or the stream lost sync.
    #[error("bad frame magic {found:02x?} (expected {MAGIC:02x?})")]
    BadMagic {
        /// The four bytes found.
        found: [u8; 4],
    },
    /// The peer speaks another protocol version.
    #[error("peer speaks protocol version {theirs}, this side {ours}")]
    Version {
        /// [`VERSION`].
        ours: u16,
        /// The peer's.
        theirs: u16,
    },
    /// A frame's payload is over [`MAX_PAYLOAD_BYTES`].
    #[error("frame payload of {bytes} bytes is over the limit of {limit}")]
    FrameTooLarge {
        /// Declared (or, when sending, encoded) payload bytes.
        bytes: u64,
        /// [`MAX_PAYLOAD_BYTES`].
        limit: usize,
    },
    /// More file descriptors than [`MAX_FDS`] arrived or were declared.
    #[error("{count} file descriptors, over the limit of {limit}")]
    TooManyFds {
        /// Descriptors declared, received or pending.
        count: usize,
        /// The limit that applies.
        limit: usize,
    },
    /// A frame carried another number of file descriptors than its header or message calls for.
    #[error("{what} calls for {expected} file descriptors, {got} came")]
    FdCount {
        /// The frame header or the message kind.
        what: &'static str,
        /// Descriptors it calls for.
        expected: usize,
        /// Descriptors that came.
        got: usize,
    },
    /// The payload is not one well-formed message.
    #[error("undecodable payload: {0}")]
    Decode(String),
    /// A well-formed message arrived where the protocol expects another.
    #[error("expected {expected}, got {got}")]
    Unexpected {
        /// What the protocol expects.
        expected: &'static str,
        /// The message that came.
        got: &'static str,
    },
    /// A message's fields contradict each other.
    #[error("inconsistent {message}: {why}")]
    Invalid {
        /// The message kind.
        message: &'static str,
        /// What is wrong.
        why: String,
    },
}

/// How an error names a peer: by the rank its `Hello` gave, or as not yet known.
pub(crate) fn peer_label(rank: Option<u32>) -> String {
    match rank {
        Some(rank) => format!("rank {rank}"),
        None => "(before its Hello)".to_string(),
    }
}

/// Why `shard::evict_until_allocatable` stopped short.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EvictionStall {
    /// Even an empty pool admits only `most` tokens.
    NeverFits {
        /// The admission capacity of the empty pool.
        most: u64,
    },
    /// The eviction callback's last call freed no page (after `calls` calls): nothing more is
    /// evictable.
    NothingFreed {
        /// Calls made, the fruitless one included.
        calls: usize,
    },
}

impl fmt::Display for EvictionStall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NeverFits { most } => {
                write!(f, "even an empty pool admits only {most} tokens")
            }
            Self::NothingFreed { calls } => write!(
                f,
                "the eviction callback freed nothing on call {calls}: nothing more is evictable"
            ),
        }
    }
}

/// What arrived from one prefill rank of a request that is overdue: every chunk before
/// `received`, in order, and not its last status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MissingChunks {
    /// The prefill rank.
    pub rank: u32,
    /// Chunks whose status arrived: `0..received`. Chunk `received` and every later one, the
    /// final chunk among them, never did.
    pub received: u32,
}

impl fmt::Display for MissingChunks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.received {
            0 => write!(
                f,
                "prefill rank {}: no chunk arrived (chunk 0 onward missing, the final chunk among them)",
                self.rank
            ),
            n => write!(
                f,
                "prefill rank {}: chunks 0..={} arrived, chunk {n} onward missing (the final chunk among them)",
                self.rank,
                n - 1
            ),
        }
    }
}

/// A request whose deadline passed before every prefill rank had reported its last status:
/// what `transfer::Receiver::expire` returns, and the [`Error::TransferDeadline`](super::Error::TransferDeadline) it converts into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Overdue {
    /// Request id.
    pub request: u64,
    /// The request's deadline, counted from its registration.
    pub deadline: Duration,
    /// Prefill ranks sending it.
    pub ranks: u32,
    /// The ranks whose last status never came, in rank order, with the chunks that did.
    pub missing: Vec<MissingChunks>,
}

impl fmt::Display for Overdue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "request {}: no last status within its deadline of {:?} from {} of its {} prefill ranks",
            self.request,
            self.deadline,
            self.missing.len(),
            self.ranks
        )?;
        for m in &self.missing {
            write!(f, "; {m}")?;
        }
        Ok(())
    }
}

impl From<Overdue> for super::Error {
    fn from(overdue: Overdue) -> Self {
        super::Error::TransferDeadline(overdue)
    }
}

/// What part of the storage tier failed ([`Error::Storage`](super::Error::Storage)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StorageFailure {
    /// The filesystem has no room for the preallocated slot file or the journal (ENOSPC, EDQUOT).
    Full,
    /// A file or the directory could not be created or opened (permissions, a filesystem
    /// without direct I/O, a missing directory).
    Open,
    /// NIXL would not register a file or the staging memory, or has no POSIX backend.
    Register,
    /// A read, write or sync failed.
    Io,
    /// A file on disk is not what this store expects (another slot size, another rank's
    /// file, a damaged header).
    Format,
    /// A write asked of a store opened read-only.
    ReadOnly,
    // The store directory handled like a database's (docs/storage.md, "The directory").
    /// The directory or a file in it could be changed by someone else, so the store will not
    /// use it: a symbolic link (or a hard-linked file), something other than a plain file or
    /// directory, writable by group or others, or owned by another user.
    Untrusted,
    /// Another open store already writes this rank in this directory (one writer per
    /// directory and rank, held by a lock while it is open): `holder` is its process id, as
    /// its lock file says, where known.
    Locked {
        /// The process holding the lock.
        holder: Option<u32>,
    },
    /// A journal record fails its checksum (or names a slot past the file) and valid records
    /// follow it: damage, not a torn tail (refused under `Damaged::Refuse`; skipped and
    /// counted otherwise).
    Corrupt,
}

impl fmt::Display for StorageFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Full => "disk full",
            Self::Open => "cannot open",
            Self::Register => "cannot register",
            Self::Io => "I/O failed",
            Self::Format => "unexpected format",
            Self::ReadOnly => "opened read-only",
            Self::Untrusted => "untrusted",
            Self::Locked { holder: Some(pid) } => {
                return write!(f, "locked by another writer (process {pid})")
            }
            Self::Locked { holder: None } => "locked by another writer",
            Self::Corrupt => "damaged journal",
        })
    }
}
