//! The one error type of kvshard. Every fallible public call returns [`Result`]; no panic
//! crosses the API. Variants carry the numbers a caller needs to see what was wrong.

use cudarc::driver::DriverError;

pub(crate) mod causes;

// Public through the modules they describe: `shard::EvictionStall`, `ipc::wire::ProtocolError`,
// `transfer::{Overdue, MissingChunks}`.
pub use causes::StorageFailure;
use causes::{EvictionStall, Overdue, ProtocolError};

/// Result alias used across kvshard.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in kvshard.
// Exhaustive (not `#[non_exhaustive]`): the Python binding maps every variant to an exception
// class without a catch-all, so a new variant does not compile until it is mapped there too.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// This build embeds no CUDA kernels (nvcc was absent when it was compiled).
    #[error(
        "kvshard was built without CUDA kernels (no nvcc 13.0 at build time); \
         run scripts/install-cuda.sh and rebuild"
    )]
    KernelsMissing,
    /// The CUDA driver library (libcuda) could not be loaded.
    #[error("no CUDA driver: libcuda could not be loaded")]
    NoDriver,
    /// The requested GPU does not exist.
    #[error("no CUDA GPU with ordinal {ordinal} ({count} present)")]
    NoGpu {
        /// Ordinal that was asked for.
        ordinal: usize,
        /// GPUs the driver reports.
        count: usize,
    },
    /// A CUDA driver call failed.
    #[error("CUDA {call} failed: {source}")]
    Driver {
        /// The driver call or kvshard operation that failed.
        call: &'static str,
        /// The driver's own error.
        #[source]
        source: DriverError,
    },
    /// A kernel met an input entry it could not use (out of range); it skipped it.
    #[error("kernel {kernel} rejected input entry {position} (out of range)")]
    KernelRejected {
        /// Kernel name.
        kernel: &'static str,
        /// Smallest bad position in the kernel's index input.
        position: u64,
    },
    /// Two geometries that must agree do not.
    #[error("geometry mismatch: {what}: expected {expected}, got {got}")]
    GeometryMismatch {
        /// Which property differs.
        what: String,
        /// Value on the reference side.
        expected: String,
        /// Value on the other side.
        got: String,
    },
    /// A geometry is not one kvshard supports.
    #[error("invalid geometry: {0}")]
    InvalidGeometry(String),
    /// An index is outside the range it must lie in.
    #[error("{what} {index} out of range (must be < {limit})")]
    OutOfRange {
        /// What kind of index.
        what: &'static str,
        /// The offending value.
        index: i64,
        /// Exclusive bound.
        limit: u64,
    },
    /// A size or argument is malformed (empty where it must not be, misaligned, too large).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A chain prefix is not a whole number of pages.
    #[error("prefix of {tokens} tokens is not page-aligned (page size {page_size})")]
    MisalignedPrefix {
        /// Prefix length in tokens.
        tokens: usize,
        /// Page size.
        page_size: usize,
    },
    /// An owner class has fewer free pages than an allocation needs.
    #[error("owner class {owner} exhausted: need {needed} pages, {free} free")]
    Exhausted {
        /// Owner class (rank).
        owner: u32,
        /// Pages the allocation needs from that class.
        needed: usize,
        /// Pages free in that class.
        free: usize,
    },
    /// A page was freed twice.
    #[error("double free of logical page {page}")]
    DoubleFree {
        /// Logical page.
        page: u64,
    },
    /// A page that was never handed out was freed.
    #[error("free of logical page {page}, which was never allocated")]
    NeverAllocated {
        /// Logical page.
        page: u64,
    },
    /// A reserved (padding) page was used where a real page is required.
    #[error("logical page {page} is reserved (pages 0..{shard} are padding)")]
    ReservedPage {
        /// Logical page.
        page: u64,
        /// Shard size: pages below it are reserved.
        shard: u32,
    },
    /// A page is owned by another rank than the operation requires.
    #[error("logical page {page} is owned by rank {owner}, expected rank {expected}")]
    WrongOwner {
        /// Logical page.
        page: u64,
        /// Its owner.
        owner: u32,
        /// The rank the operation needs.
        expected: u32,
    },
    /// A batch needs more of a region of the attention scratch than the region holds.
    #[error(
        "the batch needs {needed} tokens of the scratch's {region} region, which holds {limit}"
    )]
    ScratchOverflow {
        /// Which region: "prefix" or "chunk".
        region: &'static str,
        /// Tokens the batch needs there.
        needed: u64,
        /// Tokens the region holds.
        limit: u64,
    },
    /// A request can never be admitted: alone, as the first request of a scheduling pass, it
    /// already exceeds a limit of the batch.
    #[error("request {request} of the scheduling pass can never be admitted: its {what} needs {needed} tokens, the limit is {limit}")]
    NeverAdmissible {
        /// Position of the request among those offered in the pass.
        request: usize,
        /// What it exceeds: "prefix region" or "chunk region".
        what: &'static str,
        /// Tokens it needs there.
        needed: u64,
        /// Tokens the batch may use there.
        limit: u64,
    },
    /// Eviction cannot make a request's tokens allocatable.
    #[error("cannot make {needed} tokens allocatable (admission capacity {capacity}): {reason}")]
    EvictionStalled {
        /// Tokens the request needs (its overhead included).
        needed: u64,
        /// The allocator's admission capacity when eviction stopped.
        capacity: u64,
        /// Why eviction stopped.
        reason: EvictionStall,
    },
    /// A byte-for-byte check of the demo failed: bytes that must be identical are not.
    #[error("verification failed: {0}")]
    Verification(String),
    /// A memory budget cannot hold what it must.
    #[error("memory budget too small: {0}")]
    BudgetTooSmall(String),
    /// A P/D transfer request is invalid or failed.
    #[error("request {request}: {reason}")]
    Transfer {
        /// Request id.
        request: u64,
        /// What went wrong.
        reason: String,
    },
    /// A chunk of a P/D transfer failed on a prefill rank: the request is failed. Deliver
    /// `transfer::ChunkStatus::from_error` of it to the decode side.
    #[error("request {request}: chunk {chunk} failed on prefill rank {rank}: {reason}")]
    ChunkFailed {
        /// Request id.
        request: u64,
        /// The prefill rank.
        rank: u32,
        /// The chunk.
        chunk: u32,
        /// Why.
        reason: String,
    },
    /// A HiCache operation is invalid or failed.
    #[error("hicache: {0}")]
    HiCache(String),
    /// A route was asked to move bytes with a [`Method`](crate::copy::Method) it cannot run; refused
    /// before anything was enqueued.
    #[error("{route} cannot move bytes with {method} (it takes {accepts})")]
    UnsupportedMethod {
        /// The method asked for, as it displays.
        method: String,
        /// The route that refused it.
        route: &'static str,
        /// The methods the route takes.
        accepts: &'static str,
    },
    /// A size, offset or count computed from the caller's input does not fit its type.
    #[error("{what} overflows")]
    Overflow {
        /// The quantity and the inputs it was computed from.
        what: String,
    },
    /// An allocation could not be had.
    #[error("out of {memory} memory: {bytes} bytes asked for {what}")]
    OutOfMemory {
        /// What the allocation was for.
        what: String,
        /// Bytes asked for.
        bytes: u64,
        /// Which memory: "device", "pinned host" or "host".
        memory: &'static str,
    },
    /// A buffer or space of one backend's address space was handed to another backend.
    #[error("{what} belongs to another address space ({owner}) than the backend it was used with ({user})")]
    ForeignMemory {
        /// What was handed over.
        what: String,
        /// The address space the memory belongs to.
        owner: String,
        /// The address space of the backend it was used with.
        user: String,
    },
    /// A page appears twice where every page must be distinct (two writes would race and one
    /// position's data would be lost).
    #[error("{what} {page} appears at positions {first} and {second}")]
    DuplicatePage {
        /// Which list.
        what: &'static str,
        /// The page.
        page: u64,
        /// First position.
        first: usize,
        /// Second position.
        second: usize,
    },
    /// An operating-system call failed (shared memory, Unix-domain sockets).
    #[error("{call} failed: {source}")]
    Os {
        /// The system call or operation that failed.
        call: &'static str,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The peer process of an IPC channel is gone: it closed the connection, was killed, or fell
    /// silent for longer than the liveness timeout.
    #[error("IPC peer {} gone: {why}", causes::peer_label(*.rank))]
    PeerGone {
        /// The peer's rank from its `Hello` (`None` before the handshake told it).
        rank: Option<u32>,
        /// How it was noticed.
        why: String,
    },
    /// An IPC peer sent bytes the wire protocol refuses; the connection is dropped.
    #[error("IPC protocol violation by peer {}: {violation}", causes::peer_label(*.rank))]
    Protocol {
        /// The peer's rank from its `Hello` (`None` before the handshake told it).
        rank: Option<u32>,
        /// What was wrong.
        #[source]
        violation: ProtocolError,
    },
    /// Waiting for an IPC peer (to connect, or to answer the handshake) took too long.
    #[error("timed out after {waited:?}: {what}")]
    Timeout {
        /// What was waited for.
        what: String,
        /// How long.
        waited: std::time::Duration,
    },
    /// The storage tier (L3) could not do what was asked: its files could not be created,
    /// opened, sized or registered, the disk is full, an I/O failed, or the files on disk are
    /// not the format this store expects. Nothing in the host or device pools was touched.
    #[error("storage {path}: {failure}: {reason}")]
    Storage {
        /// The file or directory concerned.
        path: String,
        /// What failed.
        failure: StorageFailure,
        /// The system's or NIXL's words.
        reason: String,
    },
    /// The NIXL runtime library could not be loaded (feature `nixl`): `why` says what is
    /// missing and what to install.
    #[cfg(feature = "nixl")]
    #[error("NIXL is not available: {why}")]
    NixlUnavailable {
        /// What failed, and the install step that fixes it.
        why: String,
    },
    /// A NIXL call failed (feature `nixl`).
    #[cfg(feature = "nixl")]
    #[error("NIXL {call} failed: {reason}")]
    Nixl {
        /// The NIXL operation.
        call: &'static str,
        /// NIXL's status, or what kvshard found wrong.
        reason: String,
    },
    /// The NCCL library could not be loaded.
    #[error("no NCCL: libnccl.so.2 could not be loaded (it ships in the nvidia-nccl-cu13 wheel; put its lib folder on LD_LIBRARY_PATH)")]
    NoNccl,
    /// An NCCL call failed.
    #[error("NCCL {call} failed: {reason}")]
    Nccl {
        /// The call.
        call: &'static str,
        /// NCCL's answer.
        reason: String,
    },
    /// A request chain was used after one of its pages was freed (and maybe handed to another
    /// request): the chain no longer owns it.
    #[error(
        "stale chain: logical page {page} at chain position {position} was freed since the chain \
         took it (generation {taken}, now {current})"
    )]
    StaleChain {
        /// The logical page.
        page: u64,
        /// Its position in the chain.
        position: usize,
        /// The page's generation when the chain took it.
        taken: u64,
        /// Its generation now.
        current: u64,
    },
    /// A request chain was used with another allocator than the one its pages came from.
    #[error("a chain of allocator {chain} was used with allocator {allocator}")]
    ForeignAllocator {
        /// The identity of the chain's allocator.
        chain: u64,
        /// The identity of the allocator it was used with.
        allocator: u64,
    },
    /// A page that must be handed out now is not: never allocated, or freed since.
    #[error("logical page {page} is not allocated (never handed out, or freed since)")]
    NotAllocated {
        /// The logical page.
        page: u64,
    },
    // Caller-given sizes and durations outside what kvshard takes.
    /// A size, count or duration the caller gave is outside what kvshard takes (zero where at
    /// least one is needed, more than any host holds, not a finite non-negative number of
    /// seconds); refused before anything was done.
    #[error("{what} of {value}: {expected}")]
    OutOfBounds {
        /// What was given ("a budget's chunk size").
        what: String,
        /// The value, as given.
        value: String,
        /// What is taken.
        expected: String,
    },
    /// A P/D request's deadline passed before every prefill rank had reported its last status
    /// (a final chunk never sent, a status never delivered, a rank gone silent): the request,
    /// and per rank whose last status never came, the chunks that did arrive.
    #[error("{0}")]
    TransferDeadline(Overdue),

    // Decode context parallelism (docs/dcp.md).
    /// A decode layout no decode server can have: no rank, more than
    /// [`KVS_DECODE_MAX_RANKS`](crate::abi::KVS_DECODE_MAX_RANKS), or an interleave of no token.
    #[error("a decode layout of {ranks} ranks interleaving {interleave} tokens (need 1 to {} ranks and at least 1 token)", crate::abi::KVS_DECODE_MAX_RANKS)]
    InvalidDecodeLayout {
        /// Ranks asked for (M).
        ranks: u32,
        /// Tokens per turn asked for (I).
        interleave: u32,
    },
}

impl Error {
    /// Wraps a driver error with the call that produced it.
    pub(crate) fn driver(call: &'static str) -> impl FnOnce(DriverError) -> Error {
        move |source| Error::Driver { call, source }
    }

    /// An [`Error::Overflow`] naming `what`.
    pub(crate) fn overflow(what: impl Into<String>) -> Error {
        Error::Overflow { what: what.into() }
    }

    /// An [`Error::OutOfBounds`]: `what` of `value`, where `expected` is taken.
    pub(crate) fn out_of_bounds(
        what: impl Into<String>,
        value: impl std::fmt::Display,
        expected: impl Into<String>,
    ) -> Error {
        Error::OutOfBounds {
            what: what.into(),
            value: value.to_string(),
            expected: expected.into(),
        }
    }
}

/// Checked arithmetic that names what overflowed: every size, offset and count computed from a
/// caller's input goes through these, in release and debug builds alike.
pub(crate) trait Checked: Sized {
    /// `self + rhs`, or an [`Error::Overflow`] naming `what`.
    fn add_or(self, rhs: Self, what: impl FnOnce() -> String) -> Result<Self>;
    /// `self * rhs`, or an [`Error::Overflow`] naming `what`.
    fn mul_or(self, rhs: Self, what: impl FnOnce() -> String) -> Result<Self>;
}

macro_rules! checked {
    ($($t:ty),*) => {$(
        impl Checked for $t {
            fn add_or(self, rhs: Self, what: impl FnOnce() -> String) -> Result<Self> {
                self.checked_add(rhs).ok_or_else(|| Error::overflow(what()))
            }
            fn mul_or(self, rhs: Self, what: impl FnOnce() -> String) -> Result<Self> {
                self.checked_mul(rhs).ok_or_else(|| Error::overflow(what()))
            }
        }
    )*};
}
checked!(u32, u64, usize);

/// `value` as a `usize`, or an [`Error::Overflow`] naming `what` (a 64-bit count on a host
/// whose address space cannot index it).
pub(crate) fn to_usize(value: u64, what: impl FnOnce() -> String) -> Result<usize> {
    usize::try_from(value).map_err(|_| Error::overflow(what()))
}
