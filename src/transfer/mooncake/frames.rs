//! The side channel's wire format: what a Mooncake decode side and its prefill ranks say to
//! each other beside the engine's transfers (the engine carries no notification), one TCP
//! connection per prefill rank.
//!
//! **Frames.** A 12-byte header, then the payload (little-endian):
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `KVSM` ([`MAGIC`]) |
//! | 4..6 | version ([`VERSION`]) |
//! | 6..8 | flags, 0 |
//! | 8..12 | payload bytes (at most [`MAX_FRAME_BYTES`]) |
//!
//! The payload is one [`Frame`] in the postcard format (its variant order is part of the
//! protocol). A [`FrameReader`] checks each header before it buffers the payload, so a peer
//! cannot make it hold more than one frame's cap; it decodes every frame whole (no trailing
//! bytes) and checks what a frame says about itself ([`Frame::check`]); the first violation
//! ends the connection: the reader hands out the good frames before it, then refuses everything.
//! What a frame means to the receiving side (a rank, a slot, a chunk it expects) is checked
//! there ([`super::MooncakeReceiver`]).

use serde::{Deserialize, Serialize};

use crate::chunk_status::{ChunkResult, ChunkStatus};
use crate::error::causes::ProtocolError;
use crate::geometry::{CacheGeometry, Component};

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"KVSM";
/// The side channel's protocol version.
pub const VERSION: u16 = 1;
/// Bytes of a frame header.
pub const HEADER_BYTES: usize = 12;
/// Largest payload a frame may carry: 1 MiB, as the control channel's (a registration of
/// tens of thousands of pages, or a hello naming hundreds of layers, is far below it).
pub const MAX_FRAME_BYTES: usize = 1 << 20;

/// One component of a cache as both sides compare it: (component code, stored layers, block
/// bytes). Two sides of a transfer must have equal shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shape {
    /// [`component_code`] of the component.
    pub component: u8,
    /// Stored layers.
    pub layers: u32,
    /// Bytes of one (page, layer) block.
    pub block_bytes: u64,
}

/// The shape of every component of `geometry`, in `geometry.components()` order.
pub fn shape_of(geometry: &CacheGeometry) -> Vec<Shape> {
    geometry
        .components()
        .iter()
        .map(|c| Shape {
            component: component_code(c.component),
            layers: c.layers() as u32,
            block_bytes: c.block_bytes as u64,
        })
        .collect()
}

/// A section of a chunk packed into a bounce slot: entry `j` of its components goes to decode
/// page `pages[j]` (what [`crate::transfer::PackedSection`] says, in wire form).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireSection {
    /// [`component_code`]s of the section's components, in send order.
    pub components: Vec<u8>,
    /// Decode page of each packed entry.
    pub pages: Vec<u64>,
}

/// A chunk that went through a bounce slot: the slot (of those the decode keeps for the rank)
/// and its sections.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bounced {
    /// The slot.
    pub slot: u32,
    /// The sections packed into it, in the buffer's order.
    pub sections: Vec<WireSection>,
}

/// A chunk packed densely for one decode context-parallel rank (docs/dcp.md, "Over NIXL and
/// Mooncake"): the slot its region went through, the layout and the rank it was packed for,
/// and what the rank needs to unpack it (a [`crate::transfer::DenseChunk`] in wire form).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireDense {
    /// The slot (of those the decode rank keeps for the prefill rank).
    pub slot: u32,
    /// Decode ranks of the layout.
    pub ranks: u32,
    /// Interleave of the layout, in tokens.
    pub interleave: u32,
    /// The decode rank the region was packed for.
    pub rank: u32,
    /// Rows of tokens at or past this were not moved.
    pub end_token: u64,
    /// Per section (at most two: the latent KV, the indexer state), its [`component_code`]s and
    /// the sequence pages whose rows of the rank it carries, in packing order.
    pub sections: Vec<(Vec<u8>, Vec<u64>)>,
}

/// One message of the side channel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Frame {
    /// Prefill → decode, first: the rank and its cache's shape.
    Hi {
        /// The prefill rank.
        rank: u32,
        /// Its cache, as [`shape_of`] says.
        shape: Vec<Shape>,
    },
    /// Decode → prefill, the answer to `Hi`: where to write.
    Hello {
        /// The decode's engine (what the rank's engine names as its target).
        engine: String,
        /// Engine address of every stored layer of every component of the decode pool.
        bases: Vec<Vec<u64>>,
        /// Pages per layer of the decode pool.
        pages: u64,
        /// `(address, bytes)` of each of the decode's bounce buffers for this rank, one per
        /// slot.
        bounce: Vec<(u64, u64)>,
    },
    /// Decode → prefill, the answer to `Hi`: refused (another shape, a rank out of range or
    /// taken); the connection closes.
    Refused {
        /// Why.
        why: String,
    },
    /// Decode → prefill: a request to send, as a registration's fields.
    Register {
        /// Request id.
        request: u64,
        /// Leading pages the decode holds already.
        prefix_pages: u64,
        /// Decode page of each position after the prefix.
        pages: Vec<u64>,
        /// Decode page of the indexer state of each position from 0.
        state_pages: Vec<u64>,
    },
    /// Decode → prefill: bounce slot `slot`, which held chunk `chunk` of `request`, may be
    /// written again (the decode has scattered it, or will not).
    Free {
        /// The slot.
        slot: u32,
        /// The request of the chunk it held.
        request: u64,
        /// The chunk it held.
        chunk: u32,
    },
    /// Prefill → decode: a chunk's status, sent once its bytes have landed (or it failed).
    Status {
        /// The status, as it is.
        status: ChunkStatus,
        /// The bounce slot it went through (a failed chunk has none).
        bounced: Option<Bounced>,
    },
    /// Decode → prefill: the decode gives up `request` (its deadline passed); the rank sends
    /// nothing more of it and answers with `Aborted` once none of its transfers is in flight.
    Abort {
        /// Request id.
        request: u64,
        /// Why.
        reason: String,
    },
    /// Prefill → decode, the answer to `Abort`: every status of the request this rank will
    /// send was sent before this frame, and no transfer of it is in flight.
    Aborted {
        /// Request id.
        request: u64,
        /// `(slot, chunk)` of each bounce slot still holding a chunk of the request: the decode
        /// frees those it is not scattering (their statuses never reached it).
        held: Vec<(u32, u32)>,
    },
    /// Prefill → decode context-parallel rank: a chunk's status, sent once its bytes have
    /// landed, for a chunk packed densely for the rank (a rank the chunk moves no row to, and
    /// a failed chunk, get a plain `Status`). Last in the enum: the variant order is the wire's.
    DenseStatus {
        /// The status, as the decode rank receives it.
        status: ChunkStatus,
        /// The region and how to unpack it.
        dense: WireDense,
    },
}

impl Frame {
    /// The frame kind's name.
    pub fn name(&self) -> &'static str {
        match self {
            Frame::Hi { .. } => "Hi",
            Frame::Hello { .. } => "Hello",
            Frame::Refused { .. } => "Refused",
            Frame::Register { .. } => "Register",
            Frame::Free { .. } => "Free",
            Frame::Status { .. } => "Status",
            Frame::Abort { .. } => "Abort",
            Frame::Aborted { .. } => "Aborted",
            Frame::DenseStatus { .. } => "DenseStatus",
        }
    }

    /// What a frame must say of itself: known component codes, distinct within a section and
    /// a shape; no section without components or pages; a failed chunk bounced nothing; a
    /// dense region of one or two sections, for a rank of its layout.
    pub fn check(&self) -> Result<(), ProtocolError> {
        let invalid = |why: String| ProtocolError::Invalid {
            message: self.name(),
            why,
        };
        match self {
            Frame::Hi { shape, .. } => {
                distinct_codes(shape.iter().map(|s| s.component)).map_err(invalid)
            }
            Frame::Status { status, bounced } => {
                let Some(b) = bounced else { return Ok(()) };
                if matches!(status.result, ChunkResult::Failed { .. }) {
                    return Err(invalid("a failed chunk with a bounce slot".into()));
                }
                if b.sections.is_empty() {
                    return Err(invalid("a bounce slot holding no section".into()));
                }
                for s in &b.sections {
                    if s.components.is_empty() || s.pages.is_empty() {
                        return Err(invalid("a section without components or pages".into()));
                    }
                    distinct_codes(s.components.iter().copied()).map_err(invalid)?;
                }
                Ok(())
            }
            Frame::DenseStatus { status, dense } => {
                if matches!(status.result, ChunkResult::Failed { .. }) {
                    return Err(invalid("a failed chunk with a dense region".into()));
                }
                if dense.rank >= dense.ranks {
                    return Err(invalid(format!(
                        "decode rank {} of a layout of {}",
                        dense.rank, dense.ranks
                    )));
                }
                if dense.sections.is_empty() || dense.sections.len() > 2 {
                    return Err(invalid(format!(
                        "a dense region of {} sections (one or two)",
                        dense.sections.len()
                    )));
                }
                for (components, positions) in &dense.sections {
                    if components.is_empty() || positions.is_empty() {
                        return Err(invalid("a section without components or pages".into()));
                    }
                    distinct_codes(components.iter().copied()).map_err(invalid)?;
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

/// Checks component codes: each known, none twice.
fn distinct_codes(codes: impl Iterator<Item = u8>) -> Result<(), String> {
    let mut seen = [false; Component::ALL.len()];
    for code in codes {
        let at = seen
            .get_mut(usize::from(code))
            .ok_or_else(|| format!("component code {code}"))?;
        if *at {
            return Err(format!("component code {code} twice"));
        }
        *at = true;
    }
    Ok(())
}

/// The code of `c` on the wire: its index in [`Component::ALL`].
pub fn component_code(c: Component) -> u8 {
    Component::ALL.iter().position(|&x| x == c).unwrap_or(0) as u8
}

/// The component of a code [`Frame::check`] accepted.
pub fn component_of(code: u8) -> Option<Component> {
    Component::ALL.get(usize::from(code)).copied()
}

/// A frame's bytes, header included. A frame over [`MAX_FRAME_BYTES`] (or one that says
/// something [`Frame::check`] refuses) is refused, never sent.
pub fn encode(frame: &Frame) -> Result<Vec<u8>, ProtocolError> {
    frame.check()?;
    let mut out = vec![0u8; HEADER_BYTES];
    let mut out = postcard::to_extend(frame, std::mem::take(&mut out))
        .map_err(|e| ProtocolError::Decode(format!("cannot encode a {}: {e}", frame.name())))?;
    let payload = out.len() - HEADER_BYTES;
    if payload > MAX_FRAME_BYTES {
        return Err(ProtocolError::FrameTooLarge {
            bytes: payload as u64,
            limit: MAX_FRAME_BYTES,
        });
    }
    out[0..4].copy_from_slice(&MAGIC);
    out[4..6].copy_from_slice(&VERSION.to_le_bytes());
    out[8..12].copy_from_slice(&(payload as u32).to_le_bytes());
    Ok(out)
}

/// The payload length a header announces, once the header is checked.
fn header(bytes: &[u8; HEADER_BYTES]) -> Result<usize, ProtocolError> {
    let invalid = |why: String| ProtocolError::Invalid {
        message: "frame header",
        why,
    };
    if bytes[0..4] != MAGIC {
        return Err(invalid(format!(
            "magic {:02x?}, not a kvshard side channel's {MAGIC:02x?}",
            &bytes[0..4]
        )));
    }
    let theirs = u16::from_le_bytes([bytes[4], bytes[5]]);
    if theirs != VERSION {
        return Err(ProtocolError::Version {
            ours: VERSION,
            theirs,
        });
    }
    let flags = u16::from_le_bytes([bytes[6], bytes[7]]);
    if flags != 0 {
        return Err(invalid(format!("flags {flags:#x}")));
    }
    let payload = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize;
    if payload > MAX_FRAME_BYTES {
        return Err(ProtocolError::FrameTooLarge {
            bytes: payload as u64,
            limit: MAX_FRAME_BYTES,
        });
    }
    Ok(payload)
}

/// One connection's incoming bytes, turned into frames (module docs). It holds at most one
/// incomplete frame, never more than [`HEADER_BYTES`] + [`MAX_FRAME_BYTES`] bytes.
#[derive(Debug, Default)]
pub struct FrameReader {
    buf: Vec<u8>,
    broken: Option<ProtocolError>,
    frames: u64,
}

impl FrameReader {
    /// A reader that has read nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes the next bytes of the stream; returns the frames they complete, in order, and the
    /// violation that ended the stream, if one did (the frames before it are good). After a
    /// violation every call returns it again and no frame: close the connection.
    pub fn feed(&mut self, bytes: &[u8]) -> (Vec<Frame>, Option<ProtocolError>) {
        if let Some(e) = &self.broken {
            return (Vec::new(), Some(e.clone()));
        }
        let mut frames = Vec::new();
        let mut bytes = bytes;
        loop {
            // Only what completes the current frame's header, then its payload, is buffered.
            let want = match self.needed() {
                Ok(want) => want,
                Err(e) => return self.fail(frames, e),
            };
            if want > 0 {
                let take = want.min(bytes.len());
                self.buf.extend_from_slice(&bytes[..take]);
                bytes = &bytes[take..];
                if take < want {
                    return (frames, None);
                }
                continue;
            }
            let decoded = postcard::take_from_bytes::<Frame>(&self.buf[HEADER_BYTES..])
                .map_err(|e| ProtocolError::Decode(e.to_string()))
                .and_then(|(frame, rest)| {
                    if rest.is_empty() {
                        Ok(frame)
                    } else {
                        Err(ProtocolError::Invalid {
                            message: frame.name(),
                            why: format!("{} trailing bytes", rest.len()),
                        })
                    }
                })
                .and_then(|frame| frame.check().map(|()| frame));
            match decoded {
                Ok(frame) => {
                    self.buf.clear();
                    self.frames += 1;
                    frames.push(frame);
                }
                Err(e) => return self.fail(frames, e),
            }
        }
    }

    /// Bytes the current frame still needs before it can be decoded (0: it is whole).
    fn needed(&self) -> Result<usize, ProtocolError> {
        if self.buf.len() < HEADER_BYTES {
            return Ok(HEADER_BYTES - self.buf.len());
        }
        let mut head = [0u8; HEADER_BYTES];
        head.copy_from_slice(&self.buf[..HEADER_BYTES]);
        Ok(HEADER_BYTES + header(&head)? - self.buf.len())
    }

    fn fail(
        &mut self,
        frames: Vec<Frame>,
        e: ProtocolError,
    ) -> (Vec<Frame>, Option<ProtocolError>) {
        self.buf = Vec::new();
        self.broken = Some(e.clone());
        (frames, Some(e))
    }

    /// The violation that ended the stream, if one did.
    pub fn broken(&self) -> Option<&ProtocolError> {
        self.broken.as_ref()
    }

    /// Bytes held of an incomplete frame.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Frames read so far.
    pub fn frames(&self) -> u64 {
        self.frames
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunk_status::ComponentBytes;

    fn status(chunk: u32) -> ChunkStatus {
        let mut bytes = ComponentBytes::default();
        bytes.add(Component::TargetLatent, 4096);
        ChunkStatus {
            request: 7,
            rank: 1,
            chunk,
            result: ChunkResult::Sent { bytes, last: false },
        }
    }

    fn frames() -> Vec<Frame> {
        vec![
            Frame::Hi {
                rank: 1,
                shape: vec![Shape {
                    component: 0,
                    layers: 3,
                    block_bytes: 36864,
                }],
            },
            Frame::Hello {
                engine: "127.0.0.1:1234".into(),
                bases: vec![vec![1 << 40, 2 << 40]],
                pages: 128,
                bounce: vec![(4096, 1 << 20)],
            },
            Frame::Refused { why: "no".into() },
            Frame::Register {
                request: 7,
                prefix_pages: 1,
                pages: vec![3, 4],
                state_pages: vec![2, 3, 4],
            },
            Frame::Free {
                slot: 1,
                request: 7,
                chunk: 0,
            },
            Frame::Status {
                status: status(0),
                bounced: Some(Bounced {
                    slot: 1,
                    sections: vec![WireSection {
                        components: vec![0, 2],
                        pages: vec![9, 10],
                    }],
                }),
            },
            Frame::Abort {
                request: 7,
                reason: "late".into(),
            },
            Frame::Aborted {
                request: 7,
                held: vec![(1, 2)],
            },
            Frame::DenseStatus {
                status: status(1),
                dense: dense(),
            },
        ]
    }

    fn dense() -> WireDense {
        WireDense {
            slot: 1,
            ranks: 2,
            interleave: 1,
            rank: 1,
            end_token: 300,
            sections: vec![(vec![0, 2], vec![3, 4]), (vec![1, 3], vec![0, 1, 2, 3, 4])],
        }
    }

    #[test]
    fn frames_round_trip_one_byte_at_a_time_and_all_at_once() {
        let all = frames();
        let bytes: Vec<u8> = all.iter().flat_map(|f| encode(f).unwrap()).collect();
        let mut r = FrameReader::new();
        let (got, err) = r.feed(&bytes);
        assert_eq!((got, err), (all.clone(), None));
        let mut r = FrameReader::new();
        let mut got = Vec::new();
        for b in &bytes {
            let (f, err) = r.feed(std::slice::from_ref(b));
            assert!(err.is_none());
            got.extend(f);
            assert!(r.buffered() <= HEADER_BYTES + MAX_FRAME_BYTES);
        }
        assert_eq!(got, all);
        assert_eq!(r.frames(), all.len() as u64);
    }

    #[test]
    fn a_bad_frame_ends_the_stream_after_the_good_ones_before_it() {
        let good = encode(&Frame::Aborted {
            request: 1,
            held: Vec::new(),
        })
        .unwrap();
        let mut bad_magic = good.clone();
        bad_magic[0] = b'X';
        let mut bad_version = good.clone();
        bad_version[4] = 9;
        let mut flags = good.clone();
        flags[6] = 1;
        let mut oversize = good.clone();
        oversize[8..12].copy_from_slice(&(MAX_FRAME_BYTES as u32 + 1).to_le_bytes());
        let mut trailing = good.clone();
        trailing.push(0);
        let len = (trailing.len() - HEADER_BYTES) as u32;
        trailing[8..12].copy_from_slice(&len.to_le_bytes());
        let mut unknown = good.clone();
        unknown[HEADER_BYTES] = 200;
        let negative_slot = {
            // A failed chunk may not name a slot.
            let f = Frame::Status {
                status: ChunkStatus {
                    result: ChunkResult::Failed { reason: "x".into() },
                    ..status(0)
                },
                bounced: Some(Bounced {
                    slot: 0,
                    sections: vec![WireSection {
                        components: vec![0],
                        pages: vec![1],
                    }],
                }),
            };
            let mut out = vec![0u8; HEADER_BYTES];
            out = postcard::to_extend(&f, out).unwrap();
            let len = (out.len() - HEADER_BYTES) as u32;
            out[0..4].copy_from_slice(&MAGIC);
            out[4..6].copy_from_slice(&VERSION.to_le_bytes());
            out[8..12].copy_from_slice(&len.to_le_bytes());
            out
        };
        for (what, bad) in [
            ("magic", bad_magic),
            ("version", bad_version),
            ("flags", flags),
            ("oversize", oversize),
            ("trailing", trailing),
            ("unknown variant", unknown),
            ("failed and bounced", negative_slot),
        ] {
            let mut stream = good.clone();
            stream.extend(&bad);
            stream.extend(&good);
            let mut r = FrameReader::new();
            let (frames, err) = r.feed(&stream);
            assert_eq!(frames.len(), 1, "{what}: the good frame before it");
            assert!(err.is_some(), "{what}: refused");
            assert!(r.buffered() == 0 && r.broken().is_some(), "{what}");
            let (frames, err) = r.feed(&good);
            assert!(frames.is_empty() && err.is_some(), "{what}: stays refused");
        }
        // An announced length over the cap is refused from its header alone.
        let mut r = FrameReader::new();
        let mut head = good[..HEADER_BYTES].to_vec();
        head[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            r.feed(&head).1,
            Some(ProtocolError::FrameTooLarge { .. })
        ));
    }

    #[test]
    fn frames_that_contradict_themselves_are_refused_and_never_sent() {
        for f in [
            Frame::Hi {
                rank: 0,
                shape: vec![
                    Shape {
                        component: 1,
                        layers: 1,
                        block_bytes: 1,
                    };
                    2
                ],
            },
            Frame::Status {
                status: status(0),
                bounced: Some(Bounced {
                    slot: 0,
                    sections: Vec::new(),
                }),
            },
            Frame::Status {
                status: status(0),
                bounced: Some(Bounced {
                    slot: 0,
                    sections: vec![WireSection {
                        components: vec![4],
                        pages: vec![1],
                    }],
                }),
            },
            Frame::Status {
                status: status(0),
                bounced: Some(Bounced {
                    slot: 0,
                    sections: vec![WireSection {
                        components: vec![0],
                        pages: Vec::new(),
                    }],
                }),
            },
            Frame::DenseStatus {
                status: ChunkStatus {
                    result: ChunkResult::Failed { reason: "x".into() },
                    ..status(0)
                },
                dense: dense(),
            },
            Frame::DenseStatus {
                status: status(0),
                dense: WireDense { rank: 2, ..dense() },
            },
            Frame::DenseStatus {
                status: status(0),
                dense: WireDense {
                    sections: Vec::new(),
                    ..dense()
                },
            },
            Frame::DenseStatus {
                status: status(0),
                dense: WireDense {
                    sections: vec![(vec![0], vec![1]); 3],
                    ..dense()
                },
            },
            Frame::DenseStatus {
                status: status(0),
                dense: WireDense {
                    sections: vec![(vec![0, 0], vec![1])],
                    ..dense()
                },
            },
            Frame::DenseStatus {
                status: status(0),
                dense: WireDense {
                    sections: vec![(vec![0], Vec::new())],
                    ..dense()
                },
            },
        ] {
            assert!(encode(&f).is_err(), "{f:?}");
        }
        let huge = Frame::Register {
            request: 1,
            prefix_pages: 0,
            pages: vec![u64::MAX; MAX_FRAME_BYTES / 8],
            state_pages: Vec::new(),
        };
        assert!(matches!(
            encode(&huge),
            Err(ProtocolError::FrameTooLarge { .. })
        ));
    }
}
