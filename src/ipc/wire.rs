//! The wire format of the control channel: frame header, messages and limits.
//!
//! Geometry and page numbers travel as plain numbers and strings, so this module depends on no
//! other kvshard type but the one chunk status ([`ChunkStatus`], carried as it is) and its
//! limits and `ProtocolError`, defined with the error type: the two processes may be built from
//! different revisions of the crate as long as they speak the same [`VERSION`].

use crate::gpu::vmm::HANDLE_BYTES;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::chunk_status::ChunkStatus;

// The limits a violation names, and the violation itself, sit with the error type (the bottom of
// the crate) so it depends on nothing above it.
pub use crate::error::causes::{ProtocolError, MAGIC, MAX_FDS, MAX_PAYLOAD_BYTES, VERSION};

/// Bytes in a frame header.
pub const HEADER_BYTES: usize = 12;

/// A frame header: how many descriptors and payload bytes follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// File descriptors attached to the frame.
    pub fds: u16,
    /// Payload bytes after the header.
    pub payload: u32,
}

impl Header {
    /// The header's bytes (magic and version included).
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut out = [0; HEADER_BYTES];
        out[0..4].copy_from_slice(&MAGIC);
        out[4..6].copy_from_slice(&VERSION.to_le_bytes());
        out[6..8].copy_from_slice(&self.fds.to_le_bytes());
        out[8..12].copy_from_slice(&self.payload.to_le_bytes());
        out
    }

    /// Parses and checks a header: magic, version and both limits.
    pub fn decode(bytes: &[u8; HEADER_BYTES]) -> Result<Header, ProtocolError> {
        let found = [bytes[0], bytes[1], bytes[2], bytes[3]];
        if found != MAGIC {
            return Err(ProtocolError::BadMagic { found });
        }
        let theirs = u16::from_le_bytes([bytes[4], bytes[5]]);
        if theirs != VERSION {
            return Err(ProtocolError::Version {
                ours: VERSION,
                theirs,
            });
        }
        let fds = u16::from_le_bytes([bytes[6], bytes[7]]);
        if usize::from(fds) > MAX_FDS {
            return Err(ProtocolError::TooManyFds {
                count: fds.into(),
                limit: MAX_FDS,
            });
        }
        let payload = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
        if payload as usize > MAX_PAYLOAD_BYTES {
            return Err(ProtocolError::FrameTooLarge {
                bytes: payload.into(),
                limit: MAX_PAYLOAD_BYTES,
            });
        }
        Ok(Header { fds, payload })
    }
}

/// A 64-byte opaque handle: a CUDA fabric handle, IPC memory handle or IPC event handle.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Handle64(pub [u8; HANDLE_BYTES]);

impl std::fmt::Debug for Handle64 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Handle64(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "..)")
    }
}

impl From<[u8; HANDLE_BYTES]> for Handle64 {
    fn from(bytes: [u8; HANDLE_BYTES]) -> Self {
        Handle64(bytes)
    }
}

// serde implements arrays only up to 32 elements: a handle travels as a byte string whose length
// the decoder checks.
impl Serialize for Handle64 {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for Handle64 {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Handle64;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{HANDLE_BYTES} bytes")
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Handle64, E> {
                <[u8; HANDLE_BYTES]>::try_from(v)
                    .map(Handle64)
                    .map_err(|_| E::invalid_length(v.len(), &self))
            }
        }
        deserializer.deserialize_bytes(Visitor)
    }
}

/// Which side of the disaggregated pair a process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    /// Computes the KV cache and sends it.
    Prefill,
    /// Owns the destination pool and decodes.
    Decode,
}

/// The first message each side sends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// Protocol version ([`VERSION`]); must equal the receiver's.
    pub version: u16,
    /// The sender's role.
    pub role: Role,
    /// The sender's rank in its page-sharding group (0 for an unsharded decode).
    pub rank: u32,
    /// Ranks in the sender's page-sharding group (its shard size; 1 when unsharded).
    pub shard: u32,
}

impl Hello {
    /// A `Hello` of this protocol version.
    pub fn new(role: Role, rank: u32, shard: u32) -> Self {
        Hello {
            version: VERSION,
            role,
            rank,
            shard,
        }
    }
}

/// How a published pool's memory is shared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PoolSharing {
    /// CUDA VMM allocations exported as POSIX file descriptors (one attached per region).
    CudaVmmFd,
    /// CUDA VMM allocations exported as fabric handles (one per region, in the region).
    CudaFabric,
    /// Plain `cuMemAlloc` buffers shared through legacy CUDA IPC handles (one per region).
    CudaIpc,
    /// Host shared memory (memfd), the CPU twin (one descriptor attached per region).
    CpuMemfd,
}

impl PoolSharing {
    /// Whether each region travels as an attached file descriptor (rather than handle bytes).
    pub fn uses_fds(self) -> bool {
        matches!(self, PoolSharing::CudaVmmFd | PoolSharing::CpuMemfd)
    }
}

/// One separately shared allocation of a pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Region {
    /// Bytes to map (for VMM memory: the exporter's rounded size).
    pub bytes: u64,
    /// The fabric or IPC handle; `None` for the kinds that attach a descriptor instead.
    pub handle: Option<Handle64>,
}

/// Where one layer of a component starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerAt {
    /// Index into [`PublishPool::regions`].
    pub region: u32,
    /// Byte offset of the layer's page 0 inside the region.
    pub offset: u64,
}

/// One component of a pool (target latent, indexer, draft...): where each layer's pages are.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublishedComponent {
    /// The component's name, as the crate's geometry names it.
    pub name: String,
    /// Per stored layer, where its page 0 is.
    pub layers: Vec<LayerAt>,
    /// Bytes from one page to the next within a layer (0 for a zero-size component).
    pub page_stride: u64,
    /// Pages per layer.
    pub pages: u64,
}

/// Decode → prefill: the destination pool and how to map it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublishPool {
    /// The pool's id, unique within the decode process.
    pub pool: u64,
    /// How the regions are shared.
    pub memory: PoolSharing,
    /// The separately shared allocations, in the order of the attached descriptors.
    pub regions: Vec<Region>,
    /// The pool's components.
    pub components: Vec<PublishedComponent>,
    /// The pool geometry as the decode side describes it (opaque here; the receiver checks it
    /// against its own).
    pub geometry: Vec<u8>,
}

impl PublishPool {
    fn check(&self) -> Result<(), String> {
        if self.regions.is_empty() {
            return Err("no regions".into());
        }
        for (i, r) in self.regions.iter().enumerate() {
            if r.bytes == 0 {
                return Err(format!("region {i} is empty"));
            }
            if r.handle.is_some() == self.memory.uses_fds() {
                return Err(format!(
                    "region {i} {} a handle, which {:?} memory {}",
                    if r.handle.is_some() { "has" } else { "lacks" },
                    self.memory,
                    if self.memory.uses_fds() {
                        "sends as a descriptor"
                    } else {
                        "needs"
                    }
                ));
            }
        }
        for c in &self.components {
            let extent = c.page_stride.checked_mul(c.pages).ok_or_else(|| {
                format!(
                    "component {:?}: {} pages of {} bytes overflow",
                    c.name, c.pages, c.page_stride
                )
            })?;
            for (layer, at) in c.layers.iter().enumerate() {
                let region = self.regions.get(at.region as usize).ok_or_else(|| {
                    format!(
                        "component {:?} layer {layer}: region {} of {}",
                        c.name,
                        at.region,
                        self.regions.len()
                    )
                })?;
                if at
                    .offset
                    .checked_add(extent)
                    .is_none_or(|end| end > region.bytes)
                {
                    return Err(format!(
                        "component {:?} layer {layer}: [{}, +{extent}) is outside region {} of {} bytes",
                        c.name, at.offset, at.region, region.bytes
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Decode → prefill: where a request's pages go (a `transfer::Registration` on the wire).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Register {
    /// Request id.
    pub request: u64,
    /// The published pool ([`PublishPool::pool`]) the pages belong to.
    pub pool: u64,
    /// Leading pages of the sequence the decode already holds (a prefix-cache hit): never sent.
    pub prefix_pages: u64,
    /// The decode pool page of every sequence position from `prefix_pages` on.
    pub pages: Vec<u64>,
    /// The decode pool page of the indexer state of every sequence position from 0 on.
    pub state_pages: Vec<u64>,
}

/// One pool's geometry as numbers: a [`NixlPeer`] carries the sender's, and the receiver
/// checks it against its own before any byte moves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WirePool {
    /// Bytes of one token's latent row (576: FP8 "trtllm", 656: FP8 "scaled", 1152: bf16).
    pub latent_row_bytes: u32,
    /// Tokens per page.
    pub page_size: u32,
    /// Indexer key elements per token.
    pub indexer_head_dim: u32,
    /// Elements per indexer scale.
    pub indexer_quant_block: u32,
    /// Per layer: whether it has its own indexer buffer.
    pub indexer_layers: Vec<bool>,
}

/// Either way (the NIXL transport): this side's NIXL agent, and the memory of it the peer may
/// address. The decode side sends its pool and the bounce slots it keeps for the receiving
/// rank; a prefill rank sends its agent (the decode answers on it when it frees a bounce slot)
/// and its geometry, with no memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NixlPeer {
    /// The NIXL agent's name (unique among the peers).
    pub agent: String,
    /// The agent's metadata (`getLocalMD`): what the peer loads to reach this side.
    pub metadata: Vec<u8>,
    /// The target pool's geometry.
    pub target: WirePool,
    /// The draft pool's geometry, when the draft runs.
    pub draft: Option<WirePool>,
    /// Whether addresses are GPU memory (NIXL VRAM) rather than host memory (DRAM).
    pub vram: bool,
    /// The GPU the memory is on (0 for host memory).
    pub device: u32,
    /// Pages per layer of the pool (0: none published).
    pub pages: u64,
    /// Per component of the geometry (in its order), per stored layer: the address of the
    /// layer's page 0, as the agent registered it.
    pub layers: Vec<Vec<u64>>,
    /// Pages one bounce slot holds (0: no bounce slots).
    pub slot_pages: u64,
    /// Address of each bounce slot this side keeps for the peer: per component, its pages
    /// page-major (`[component][page][layer][block]`).
    pub slots: Vec<u64>,
}

/// Most bounce slots a [`NixlPeer`] may announce.
pub const MAX_NIXL_SLOTS: usize = 64;

/// Everything that travels on the control channel.
///
/// The variant order is part of the wire format: append new variants, never reorder.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Message {
    /// Handshake: the first message each side sends.
    Hello(Hello),
    /// Decode → prefill: the destination pool (descriptors attached for the fd kinds).
    PublishPool(PublishPool),
    /// Decode → prefill: a request's destination pages.
    Register(Register),
    /// Prefill → decode: a chunk landed or failed (the rank's status, as it is).
    Chunk(ChunkStatus),
    /// A CUDA interprocess event (`cuIpcGetEventHandle`) the receiver may open and wait on.
    EventHandle {
        /// The event handle.
        handle: Handle64,
    },
    /// Either way: give up a request.
    Abort {
        /// Request id.
        request: u64,
        /// Why.
        reason: String,
    },
    /// Keep-alive; the channel sends and consumes these itself.
    Heartbeat,
    /// The sender is closing the connection on purpose.
    Bye,
    /// Either way: the sender's NIXL agent and memory (the NIXL transport).
    NixlPeer(NixlPeer),
}

impl Message {
    /// The message kind's name, for errors and logs.
    pub fn name(&self) -> &'static str {
        match self {
            Message::Hello(_) => "Hello",
            Message::PublishPool(_) => "PublishPool",
            Message::Register(_) => "Register",
            Message::Chunk(_) => "Chunk",
            Message::EventHandle { .. } => "EventHandle",
            Message::Abort { .. } => "Abort",
            Message::Heartbeat => "Heartbeat",
            Message::Bye => "Bye",
            Message::NixlPeer(_) => "NixlPeer",
        }
    }

    /// File descriptors that must travel with the message.
    pub fn fds_needed(&self) -> usize {
        match self {
            Message::PublishPool(p) if p.memory.uses_fds() => p.regions.len(),
            _ => 0,
        }
    }

    /// Checks the message is self-consistent and comes with `fds` descriptors.
    pub fn check(&self, fds: usize) -> Result<(), ProtocolError> {
        let expected = self.fds_needed();
        if expected > MAX_FDS {
            return Err(ProtocolError::TooManyFds {
                count: expected,
                limit: MAX_FDS,
            });
        }
        if fds != expected {
            return Err(ProtocolError::FdCount {
                what: self.name(),
                expected,
                got: fds,
            });
        }
        let invalid = |why| ProtocolError::Invalid {
            message: self.name(),
            why,
        };
        match self {
            Message::PublishPool(p) => p.check().map_err(invalid),
            Message::NixlPeer(p) if p.slots.len() > MAX_NIXL_SLOTS => Err(invalid(format!(
                "{} bounce slots, over the limit of {MAX_NIXL_SLOTS}",
                p.slots.len()
            ))),
            Message::NixlPeer(p) if p.slots.is_empty() != (p.slot_pages == 0) => Err(invalid(
                format!("{} bounce slots of {} pages", p.slots.len(), p.slot_pages),
            )),
            _ => Ok(()),
        }
    }
}

/// Encodes `msg` as one frame (header and payload) announcing `fds` descriptors, after checking
/// the message and the payload limit.
pub fn encode(msg: &Message, fds: usize) -> Result<Vec<u8>, ProtocolError> {
    msg.check(fds)?;
    let frame =
        postcard::to_extend(msg, vec![0u8; HEADER_BYTES]).map_err(|e| ProtocolError::Invalid {
            message: msg.name(),
            why: format!("cannot encode: {e}"),
        })?;
    let payload = frame.len() - HEADER_BYTES;
    if payload > MAX_PAYLOAD_BYTES {
        return Err(ProtocolError::FrameTooLarge {
            bytes: payload as u64,
            limit: MAX_PAYLOAD_BYTES,
        });
    }
    let header = Header {
        // Both fit: `check` bounded the descriptors, the line above the payload.
        fds: fds as u16,
        payload: payload as u32,
    };
    let mut frame = frame;
    frame[..HEADER_BYTES].copy_from_slice(&header.encode());
    Ok(frame)
}

/// Decodes one payload that arrived with `fds` descriptors: exactly one well-formed,
/// self-consistent message, no trailing bytes.
pub fn decode(payload: &[u8], fds: usize) -> Result<Message, ProtocolError> {
    if payload.len() > MAX_PAYLOAD_BYTES {
        return Err(ProtocolError::FrameTooLarge {
            bytes: payload.len() as u64,
            limit: MAX_PAYLOAD_BYTES,
        });
    }
    let (msg, rest) = postcard::take_from_bytes::<Message>(payload)
        .map_err(|e| ProtocolError::Decode(e.to_string()))?;
    if !rest.is_empty() {
        return Err(ProtocolError::Decode(format!(
            "{} trailing bytes after {}",
            rest.len(),
            msg.name()
        )));
    }
    msg.check(fds)?;
    Ok(msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(memory: PoolSharing) -> PublishPool {
        let handle = (!memory.uses_fds()).then_some(Handle64([7; HANDLE_BYTES]));
        PublishPool {
            pool: 3,
            memory,
            regions: vec![Region {
                bytes: 1 << 21,
                handle,
            }],
            components: vec![PublishedComponent {
                name: "target_latent".into(),
                layers: vec![LayerAt {
                    region: 0,
                    offset: 0,
                }],
                page_stride: 36_864,
                pages: 56,
            }],
            geometry: b"{}".to_vec(),
        }
    }

    #[test]
    fn frames_round_trip() {
        let msg = Message::PublishPool(pool(PoolSharing::CudaFabric));
        let frame = encode(&msg, 0).unwrap();
        let header = Header::decode(frame[..HEADER_BYTES].try_into().unwrap()).unwrap();
        assert_eq!(header.payload as usize, frame.len() - HEADER_BYTES);
        assert_eq!(decode(&frame[HEADER_BYTES..], 0).unwrap(), msg);
    }

    #[test]
    fn descriptor_counts_are_checked_both_ways() {
        let msg = Message::PublishPool(pool(PoolSharing::CpuMemfd));
        assert!(matches!(
            encode(&msg, 0),
            Err(ProtocolError::FdCount {
                expected: 1,
                got: 0,
                ..
            })
        ));
        let frame = encode(&msg, 1).unwrap();
        assert!(matches!(
            decode(&frame[HEADER_BYTES..], 2),
            Err(ProtocolError::FdCount {
                expected: 1,
                got: 2,
                ..
            })
        ));
        assert!(matches!(
            encode(&Message::Bye, 1),
            Err(ProtocolError::FdCount { expected: 0, .. })
        ));
    }

    #[test]
    fn inconsistent_pools_are_refused() {
        let mut p = pool(PoolSharing::CudaIpc);
        p.components[0].pages = 57;
        assert!(matches!(
            Message::PublishPool(p).check(0),
            Err(ProtocolError::Invalid { .. })
        ));
        let mut p = pool(PoolSharing::CudaIpc);
        p.regions[0].handle = None;
        assert!(matches!(
            Message::PublishPool(p).check(0),
            Err(ProtocolError::Invalid { .. })
        ));
        let mut p = pool(PoolSharing::CudaIpc);
        p.components[0].layers[0].region = 1;
        assert!(Message::PublishPool(p).check(0).is_err());
        let mut p = pool(PoolSharing::CudaIpc);
        p.components[0].page_stride = u64::MAX;
        assert!(Message::PublishPool(p).check(0).is_err());
    }

    #[test]
    fn headers_are_checked_before_the_payload() {
        let good = Header { fds: 1, payload: 9 }.encode();
        assert_eq!(Header::decode(&good), Ok(Header { fds: 1, payload: 9 }));
        let mut bad = good;
        bad[0] = b'X';
        assert!(matches!(
            Header::decode(&bad),
            Err(ProtocolError::BadMagic { .. })
        ));
        let mut bad = good;
        bad[4] = 9;
        assert_eq!(
            Header::decode(&bad),
            Err(ProtocolError::Version {
                ours: VERSION,
                theirs: 9
            })
        );
        let bad = Header {
            fds: 0,
            payload: u32::MAX,
        }
        .encode();
        assert!(matches!(
            Header::decode(&bad),
            Err(ProtocolError::FrameTooLarge { .. })
        ));
        let bad = Header {
            fds: 17,
            payload: 0,
        }
        .encode();
        assert!(matches!(
            Header::decode(&bad),
            Err(ProtocolError::TooManyFds { .. })
        ));
    }

    #[test]
    fn handles_must_be_64_bytes() {
        // A Handle64 field given 63 bytes: the byte-string length is the first thing decoded.
        let mut payload = postcard::to_allocvec(&Message::EventHandle {
            handle: Handle64([1; HANDLE_BYTES]),
        })
        .unwrap();
        assert_eq!(payload[1], HANDLE_BYTES as u8);
        payload[1] = 63;
        payload.pop();
        assert!(matches!(decode(&payload, 0), Err(ProtocolError::Decode(_))));
    }
}
