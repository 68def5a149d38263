//! The journal's bytes: its header and records (encoded and decoded, each with its own
//! CRC-32C), the files' names, and the records a compaction writes.

use crate::key::{PageKey, KEY_BYTES};

/// Bytes of the header.
pub(super) const HEADER_BYTES: u64 = 64;
/// Bytes of one record.
pub(super) const RECORD_BYTES: u64 = 96;
/// Records one read takes (192 KiB): what bounds a reader's memory, whatever the file's size.
pub(super) const CHUNK_RECORDS: usize = 2048;
/// The most positions one `Skip` stands for: far more than any journal ever held (2^48
/// records are 27 PB of journal), so a larger count is damage, and positions never overflow.
pub(super) const MAX_SKIP: u64 = 1 << 48;
const MAGIC: &[u8; 8] = b"KVSJRNL1";
const RECORD_MAGIC: &[u8; 4] = b"KVSR";
const VERSION: u32 = 1;

/// What a journal's header pins: a reader must agree on every field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::pool::disk) struct Header {
    pub writer: u32,
    pub page_bytes: u64,
    pub slot_bytes: u64,
    pub slots: u64,
}

impl Header {
    pub(super) fn encode(&self) -> [u8; HEADER_BYTES as usize] {
        let mut b = [0u8; HEADER_BYTES as usize];
        b[..8].copy_from_slice(MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&self.writer.to_le_bytes());
        b[16..24].copy_from_slice(&self.page_bytes.to_le_bytes());
        b[24..32].copy_from_slice(&self.slot_bytes.to_le_bytes());
        b[32..40].copy_from_slice(&self.slots.to_le_bytes());
        let crc = crc32c::crc32c(&b[..60]);
        b[60..].copy_from_slice(&crc.to_le_bytes());
        b
    }

    pub(super) fn decode(b: &[u8]) -> Option<Self> {
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or_default());
        let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap_or_default());
        (b.len() == HEADER_BYTES as usize
            && &b[..8] == MAGIC
            && u32_at(8) == VERSION
            && u32_at(60) == crc32c::crc32c(&b[..60]))
        .then(|| Self {
            writer: u32_at(12),
            page_bytes: u64_at(16),
            slot_bytes: u64_at(24),
            slots: u64_at(32),
        })
    }
}

/// One journal record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::pool::disk) enum Record {
    /// `slot` holds `key`'s page, whose bytes have CRC-32C `crc` (over the key, then the page).
    Commit { slot: u64, key: PageKey, crc: u32 },
    /// `slot` no longer holds `key`.
    Free { slot: u64, key: PageKey },
    /// `count` positions whose records compaction dropped (their pages long freed).
    Skip { count: u64 },
}

impl Record {
    pub(super) fn encode(&self) -> [u8; RECORD_BYTES as usize] {
        let mut b = [0u8; RECORD_BYTES as usize];
        b[..4].copy_from_slice(RECORD_MAGIC);
        let (kind, slot, key, crc) = match *self {
            Self::Commit { slot, key, crc } => (1u8, slot, Some(key), crc),
            Self::Free { slot, key } => (2u8, slot, Some(key), 0),
            Self::Skip { count } => (3u8, count, None, 0),
        };
        b[4] = kind;
        b[8..16].copy_from_slice(&slot.to_le_bytes());
        if let Some(key) = key {
            b[16..16 + KEY_BYTES].copy_from_slice(key.bytes());
        }
        b[80..84].copy_from_slice(&crc.to_le_bytes());
        let check = crc32c::crc32c(&b[..88]);
        b[88..92].copy_from_slice(&check.to_le_bytes());
        b
    }

    /// The record in `b`, or `None` when it is bad: another length, magic or kind, a failed
    /// checksum, a commit or free of a slot not below `slots`, a `Skip` of none or of more
    /// than [`MAX_SKIP`] positions.
    pub(super) fn decode(b: &[u8], slots: u64) -> Option<Self> {
        let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap_or_default());
        if b.len() != RECORD_BYTES as usize
            || &b[..4] != RECORD_MAGIC
            || u32_at(88) != crc32c::crc32c(&b[..88])
        {
            return None;
        }
        let slot = u64::from_le_bytes(b[8..16].try_into().ok()?);
        let key = PageKey::from_bytes(&b[16..16 + KEY_BYTES]).ok()?;
        match b[4] {
            1 if slot < slots => Some(Self::Commit {
                slot,
                key,
                crc: u32_at(80),
            }),
            2 if slot < slots => Some(Self::Free { slot, key }),
            3 if slot > 0 && slot <= MAX_SKIP => Some(Self::Skip { count: slot }),
            _ => None,
        }
    }

    /// Logical positions the record stands for.
    pub fn span(&self) -> u64 {
        match *self {
            Self::Skip { count } => count,
            _ => 1,
        }
    }
}

/// What one record place of a journal holds, as replayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::pool::disk) enum Item {
    /// A valid record.
    Record(Record),
    /// A damaged record (module docs): one position that says nothing.
    Damaged,
}

impl Item {
    /// Logical positions it stands for.
    pub fn span(&self) -> u64 {
        match self {
            Self::Record(r) => r.span(),
            Self::Damaged => 1,
        }
    }
}

/// The name of writer `writer`'s journal in the store's directory.
pub(in crate::pool::disk) fn name(writer: u32) -> String {
    format!("w{writer:04}.journal")
}

/// Where a compaction of writer `writer`'s journal is written before its rename.
pub(super) fn compact_name(writer: u32) -> String {
    format!("w{writer:04}.journal.compact")
}

/// A live commit compaction keeps: (position, slot, key, page CRC).
pub(in crate::pool::disk) type Live = (u64, u64, PageKey, u32);

/// The records of a compacted journal of `total` positions keeping `live` (sorted by position,
/// each below `total`): each commit at its position, `Skip`s between (none longer than
/// [`MAX_SKIP`]).
pub(in crate::pool::disk) fn compacted(live: &[Live], total: u64) -> Vec<Record> {
    let mut out = Vec::with_capacity(2 * live.len() + 1);
    let mut at = 0;
    let skip = |out: &mut Vec<Record>, mut count: u64| {
        while count > 0 {
            let n = count.min(MAX_SKIP);
            out.push(Record::Skip { count: n });
            count -= n;
        }
    };
    for &(position, slot, key, crc) in live {
        if position > at {
            skip(&mut out, position - at);
        }
        out.push(Record::Commit { slot, key, crc });
        at = position + 1;
    }
    if total > at {
        skip(&mut out, total - at);
    }
    out
}
