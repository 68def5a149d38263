//! The per-call-stream transport (`transfer::StreamTransport`): each chunk enqueued on the
//! stream its `StreamChoice` names when it is sent, one in-process transport per stream, made
//! on first use. Each rank's pool is written on a stream of its own, with nothing waiting, and
//! its chunks are sent on that stream: the decode pool must end byte-identical to the
//! reference, on the CPU twin in the adversarial stream order and on the GPU; chunks sent on
//! alternating streams land too, and a method no in-process transport runs is refused when
//! the transport is made, before any chunk.

mod common;

use std::sync::Arc;

use common::pd::{decode_pool, geometry, pool_bytes, reference, requests, N, PREFILL_PAGES};
use kvshard::backend::cpu::StreamOrder;
use kvshard::backend::Backend;
use kvshard::copy::{Method, RemoteSpace};
use kvshard::error::Error;
use kvshard::pool::DevicePool;
use kvshard::shard::Placement;
use kvshard::transfer::{Sender, StreamTransport, Transport};

// Chunks on the stream that wrote their pages match the reference.
common::on_cpu_and_gpu!(
    chunks_go_on_the_stream_each_send_names,
    [StreamOrder::Adversarial(3), StreamOrder::Adversarial(4)],
    |device| {
        let seed = 7;
        let reqs = requests(seed);
        let first = device.stream();
        let dst = decode_pool(first.as_ref());
        let remote = Arc::new(RemoteSpace::of(dst.clone(), geometry()).expect("remote"));
        for rank in 0..N {
            // The rank's bytes are written on a stream of their own, enqueued: only work on that
            // stream (or waiting for it) sees them.
            let stream = device.stream();
            let pool = DevicePool::allocate(
                stream.as_ref(),
                &geometry(),
                Placement::new(N).expect("placement"),
                rank,
                PREFILL_PAGES,
            )
            .expect("pool");
            let storage = pool.storage().expect("allocated").clone();
            stream
                .write_sync(&storage, 0, &pool_bytes(seed, rank, storage.len()))
                .expect("write");
            let (transport, choice) = StreamTransport::new(first.clone(), None).expect("transport");
            let stats = transport.stats().expect("stats");
            let mut sender = Sender::new(Arc::new(pool), Box::new(transport));
            choice.set(stream.clone());
            assert!(Arc::ptr_eq(&choice.get(), &stream));
            let mut pending = Vec::new();
            for r in &reqs {
                sender
                    .open(r.registration.clone(), remote.clone())
                    .expect("open");
                for &end in &r.chunks {
                    pending.push(
                        sender
                            .send(r.registration.request, &r.src_pages, end)
                            .expect("send"),
                    );
                }
            }
            for p in pending {
                p.wait_sync().expect("landed");
            }
            let snapshot = stats.snapshot();
            assert_eq!((snapshot.chunks, snapshot.failed_transfers), (9, 0));
        }
        let got = dst.snapshot_sync(first.as_ref()).expect("snapshot");
        assert!(got == reference(seed, &reqs), "differs on {device}");
    }
);

#[test]
fn chunks_on_alternating_streams_land_and_a_method_is_refused_at_once() {
    let device = kvshard::backend::cpu::CpuBackend::new();
    let a: Arc<dyn Backend> = Arc::new(device.new_stream());
    let b: Arc<dyn Backend> = Arc::new(device.new_stream());
    let refused = StreamTransport::new(a.clone(), Some(Method::BatchedCopyEngine));
    assert!(matches!(refused, Err(Error::UnsupportedMethod { .. })));
    let seed = 9;
    let reqs = requests(seed);
    let dst = decode_pool(a.as_ref());
    let remote = Arc::new(RemoteSpace::of(dst.clone(), geometry()).expect("remote"));
    let pool = common::pd::prefill_pool(a.as_ref(), seed, 0);
    let (transport, choice) =
        StreamTransport::new(a.clone(), Some(Method::CopyEngine)).expect("transport");
    let mut sender = Sender::new(pool, Box::new(transport));
    let r = &reqs[0];
    sender.open(r.registration.clone(), remote).expect("open");
    for (i, &end) in r.chunks.iter().enumerate() {
        // Alternating streams; the same stream twice reuses its transport.
        choice.set(if i % 2 == 0 { a.clone() } else { b.clone() });
        sender
            .send(r.registration.request, &r.src_pages, end)
            .expect("send")
            .wait_sync()
            .expect("landed");
    }
    let stats = sender.stats().expect("stats").snapshot();
    assert_eq!(stats.chunks, r.chunks.len() as u64);
}
