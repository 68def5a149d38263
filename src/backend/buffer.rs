//! Memory a backend reaches: a [`Buffer`] (an address, a length, the [`AddressSpace`] it means
//! something in, its [`Usage`] record) and the check that a backend only takes buffers of its
//! own space.

use std::fmt;
use std::sync::Arc;

use super::Usage;
use crate::error::{Error, Result};

/// Where a buffer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Device memory (HBM).
    Device,
    /// Pinned host memory the device can read and write directly.
    PinnedHost,
}

/// The address space a buffer's address means something in: one CPU backend's arena (shared by
/// its streams), or one GPU (shared by every stream and context handle of that device).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AddressSpace {
    /// The arena of a [`CpuBackend`](super::cpu::CpuBackend) and the streams made from it.
    Cpu(u64),
    /// CUDA device `ordinal` (its device memory and the device aliases of pinned host memory).
    Cuda(usize),
    /// Memory of another process, possibly on another host, that only a transfer engine
    /// reaches (a NIXL peer's pool): no backend runs in it, so every kernel and copy refuses it
    /// ([`Error::ForeignMemory`]). Each such destination gets an id of its own.
    Remote(u64),
}

impl fmt::Display for AddressSpace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu(id) => write!(f, "CPU backend arena {id}"),
            Self::Cuda(ordinal) => write!(f, "CUDA device {ordinal}"),
            Self::Remote(id) => write!(f, "remote memory {id}"),
        }
    }
}

/// A range of backend memory: an address kernels use, a length, the address space it belongs
/// to, and its [`Usage`]: the work queued on it and (for memory kvshard allocated) a share of
/// the allocation, which is freed only once the last share is gone and that work has completed.
#[derive(Clone)]
pub struct Buffer {
    addr: u64,
    len: usize,
    kind: MemoryKind,
    space: AddressSpace,
    usage: Usage,
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("kind", &self.kind)
            .field("space", &self.space)
            .field("usage", &self.usage)
            .finish()
    }
}

impl Buffer {
    pub(crate) fn owned(
        addr: u64,
        len: usize,
        kind: MemoryKind,
        space: AddressSpace,
        owner: Arc<dyn Send + Sync>,
    ) -> Self {
        Self {
            addr,
            len,
            kind,
            space,
            usage: Usage::new(Some(Box::new(owner))),
        }
    }

    /// This buffer's range, tracked by `usage` instead of its own record: a space shares one
    /// record among all of its buffers, and `usage` keeps this buffer's memory alive.
    pub(crate) fn tracked_by(&self, usage: &Usage) -> Buffer {
        Buffer {
            usage: usage.clone(),
            ..self.clone()
        }
    }

    /// The record of the work queued on this buffer's memory.
    pub fn usage(&self) -> &Usage {
        &self.usage
    }

    /// Wraps memory kvshard does not own (an engine's device buffers, say) in `space` (a
    /// backend's [`Backend::address_space`](super::Backend::address_space)).
    ///
    /// # Safety
    /// `[addr, addr + len)` must be memory of `space` (a device address or device alias for
    /// CUDA) that stays valid while the buffer and any work using it are alive.
    pub unsafe fn from_raw(addr: u64, len: usize, kind: MemoryKind, space: AddressSpace) -> Self {
        Self {
            addr,
            len,
            kind,
            space,
            usage: Usage::new(None),
        }
    }

    /// The address kernels use (device address or device alias).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where the memory lives.
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }

    /// The address space the buffer belongs to.
    pub fn space(&self) -> AddressSpace {
        self.space
    }

    /// The sub-range `[offset, offset + len)`, sharing this buffer's allocation.
    pub fn slice(&self, offset: usize, len: usize) -> Result<Buffer> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(Buffer {
                addr: self.addr + offset as u64,
                len,
                kind: self.kind,
                space: self.space,
                usage: self.usage.clone(),
            }),
            _ => Err(Error::InvalidArgument(format!(
                "slice [{offset}, {offset}+{len}) of a {}-byte buffer",
                self.len
            ))),
        }
    }

    /// Address of byte `offset`, checked against the length.
    pub fn at(&self, offset: usize) -> Result<u64> {
        if offset > self.len {
            return Err(Error::OutOfRange {
                what: "buffer offset",
                index: i64::try_from(offset).unwrap_or(i64::MAX),
                limit: self.len as u64 + 1,
            });
        }
        Ok(self.addr + offset as u64)
    }
}

/// Checks memory of address space `owner` may be used by a backend of space `user`.
pub(crate) fn check_space(user: AddressSpace, owner: AddressSpace, what: &str) -> Result<()> {
    if user != owner {
        return Err(Error::ForeignMemory {
            what: what.to_string(),
            owner: owner.to_string(),
            user: user.to_string(),
        });
    }
    Ok(())
}
