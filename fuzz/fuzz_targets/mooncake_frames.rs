//! The Mooncake side channel's bytes from a peer (nothing trusted): arbitrary bytes, split
//! anywhere, through a `FrameReader` and into a decode side's `MooncakeReceiver` as one rank's
//! stream. No panic; the reader never holds more than one frame's cap; after a violation it
//! stays refused; every frame it hands out re-encodes to a frame that decodes the same; the
//! receiver's slots and held statuses stay within their bounds, and a rank that broke the
//! protocol still has its requests handed back once the other rank reports.
#![no_main]

use std::sync::Arc;
use std::time::Duration;

use kvshard::backend::cpu::{CpuBackend, StreamOrder};
use kvshard::backend::Backend;
use kvshard::geometry::{CacheGeometry, LatentLayout, PoolGeometry};
use kvshard::index::LocalPage;
use kvshard::pool::DevicePool;
use kvshard::shard::Placement;
use kvshard::transfer::mooncake::frames::{self, Frame, FrameReader, HEADER_BYTES, MAX_FRAME_BYTES};
use kvshard::transfer::mooncake::{EngineAddresses, MooncakeReceiver};
use kvshard::transfer::{ChunkResult, ChunkStatus, ComponentBytes, PoolLayout, Registration};
use libfuzzer_sys::fuzz_target;

const PAGES: u64 = 16;

fn geometry() -> CacheGeometry {
    CacheGeometry::target_only(PoolGeometry::new(LatentLayout::Fp8Trtllm, 1))
}

fn receiver() -> MooncakeReceiver {
    let cpu = Arc::new(CpuBackend::with_order(StreamOrder::Immediate));
    let backend: Arc<dyn Backend> = cpu.clone();
    let pool = Arc::new(
        DevicePool::allocate(
            backend.as_ref(),
            &geometry(),
            Placement::unsharded(),
            0,
            PAGES,
        )
        .expect("pool"),
    );
    let mut r = MooncakeReceiver::new(
        pool,
        backend,
        EngineAddresses::Cpu(cpu),
        2,
        2,
        2,
        Duration::from_secs(600),
    )
    .expect("receiver");
    for rank in 0..2 {
        let hi = Frame::Hi {
            rank,
            shape: frames::shape_of(&geometry()),
        };
        assert!(r.join(&hi, "fuzz").is_ok());
    }
    for request in 1..=2u64 {
        let pages: Vec<LocalPage> = (0..2).map(|p| LocalPage(2 * request + p)).collect();
        let registration = Registration {
            request,
            layout: PoolLayout::packed(geometry(), PAGES),
            prefix_pages: 0,
            pages: pages.clone(),
            state_pages: pages,
        };
        r.register(registration, None).expect("register");
    }
    r
}

// The first byte sets the size of the pieces the rest arrives in (1 to 256 bytes), so a
// corpus entry is that byte and a stream of frames as a peer sends them.
fuzz_target!(|data: &[u8]| {
    let Some((&split, bytes)) = data.split_first() else {
        return;
    };
    let piece_len = usize::from(split) + 1;
    let mut reader = FrameReader::new();
    let mut decode = receiver();
    let mut at = 0usize;
    let mut broken = false;
    while at < bytes.len() {
        let n = piece_len.min(bytes.len() - at);
        let piece = &bytes[at..at + n];
        at += n;
        let (frames, error) = reader.feed(piece);
        assert!(reader.buffered() <= HEADER_BYTES + MAX_FRAME_BYTES);
        if broken {
            assert!(
                frames.is_empty() && error.is_some(),
                "a refused stream read on"
            );
        }
        broken |= error.is_some();
        for f in frames {
            let again = frames::encode(&f).expect("a frame read re-encodes");
            let (back, err) = FrameReader::new().feed(&again);
            assert!(err.is_none() && back == vec![f]);
        }
        let _ = decode.feed(1, piece);
        assert!(decode.busy_slots(1) <= 2);
        let _ = decode.poll();
        let _ = decode.expire();
        let _ = decode.take_outgoing(1);
    }
    // Whatever rank 1 did, once rank 0 reports and rank 1 is gone, nothing stays held.
    decode.rank_gone(1, "the fuzz input ended");
    for request in 1..=2u64 {
        let status = ChunkStatus {
            request,
            rank: 0,
            chunk: 0,
            result: ChunkResult::Sent {
                bytes: ComponentBytes::default(),
                last: true,
            },
        };
        let bytes = frames::encode(&Frame::Status {
            status,
            bounced: None,
        })
        .expect("encode");
        assert!(decode.feed(0, &bytes).is_none());
    }
    let _ = decode.poll();
    assert_eq!(decode.pending_requests(), 0, "a request stayed held");
});
