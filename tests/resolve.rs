//! Owner-local index resolution and scratch translation: the pure reference against the
//! ownership math, and the CPU twin (`cpu_*`) and the kernels (`gpu_*`, SKIPPED without a GPU)
//! against the reference from one body each, byte for byte, with poisoned outputs (bytes past
//! the count must stay poisoned).

mod common;

use common::synth::POISON;
use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::{i64s_from_bytes, upload_i64s_sync, Backend, Buffer, MemoryKind};
use kvshard::copy::{scratch_rows_device_sync, Resolver};
use kvshard::index::LocalPage;
use kvshard::shard::{resolve_owned, scratch_rows, Placement, ResolveMode, Resolved};
use kvshard::Error;
use rand::Rng;

const MODES: [ResolveMode; 2] = [ResolveMode::Tokens, ResolveMode::Pages];
const SHARDS: [u32; 5] = [1, 2, 3, 4, 8];
/// Entries are drawn below this; it is also the limit the kernel checks against.
const LIMIT: u64 = 1 << 40;

/// `n` random entries below [`LIMIT`]: ~10% padding (mostly -1), a few at `LIMIT - 1`.
fn entries(rng: &mut impl Rng, n: usize) -> Vec<i64> {
    (0..n)
        .map(|_| match rng.random_range(0..100) {
            0..9 => -1,
            9 => rng.random_range(i64::MIN..0),
            10 => LIMIT as i64 - 1,
            _ => rng.random_range(0..LIMIT as i64),
        })
        .collect()
}

fn placement(shard: u32) -> Placement {
    Placement::new(shard).unwrap()
}

/// What one launch leaves in a resolver's outputs, over the first `n` entries' worth.
#[derive(PartialEq)]
struct Outputs {
    count: Vec<u8>,
    positions: Vec<u8>,
    local: Vec<u8>,
}

impl Outputs {
    /// The bytes a launch over `n` entries must leave: `expected` then poison.
    fn expected(expected: &Resolved, n: usize) -> Outputs {
        let mut positions = Vec::with_capacity(4 * n);
        positions.extend(
            expected
                .positions
                .iter()
                .flat_map(|&p| (p as i32).to_le_bytes()),
        );
        positions.resize(4 * n, POISON);
        let mut local = Vec::with_capacity(8 * n);
        local.extend(
            expected
                .local
                .iter()
                .flat_map(|&l| (l as i64).to_le_bytes()),
        );
        local.resize(8 * n, POISON);
        Outputs {
            count: (expected.positions.len() as u64).to_le_bytes().to_vec(),
            positions,
            local,
        }
    }

    /// First difference from `other`, for a message that does not print megabytes.
    fn diff(&self, other: &Outputs) -> String {
        let first = |a: &[u8], b: &[u8]| a.iter().zip(b).position(|(x, y)| x != y);
        format!(
            "count {:?} vs {:?}; first differing byte of positions {:?}, of local {:?}",
            self.count,
            other.count,
            first(&self.positions, &other.positions),
            first(&self.local, &other.local)
        )
    }
}

/// Poisons every output, enqueues the raw launch, waits and reads `n` entries' worth back.
#[allow(clippy::too_many_arguments)]
fn run_device(
    b: &dyn Backend,
    resolver: &mut Resolver,
    input: &Buffer,
    n: usize,
    placement: Placement,
    rank: u32,
    mode: ResolveMode,
    limit: u64,
) -> Outputs {
    for out in [
        resolver.positions(),
        resolver.local(),
        resolver.count_buffer(),
    ] {
        b.fill(out, POISON).unwrap();
    }
    // SAFETY: `input` is a buffer of `b` holding n int64s at a 256-byte aligned address; the
    // resolver was made on `b` and the synchronize below finishes the launch before the outputs
    // are read or anything is launched again.
    unsafe {
        resolver
            .resolve_device(b, input.addr(), n, placement, rank, mode, limit)
            .unwrap()
    };
    b.synchronize().unwrap();
    Outputs {
        count: b.read_sync(resolver.count_buffer(), 0, 8).unwrap(),
        positions: b.read_sync(resolver.positions(), 0, 4 * n).unwrap(),
        local: b.read_sync(resolver.local(), 0, 8 * n).unwrap(),
    }
}

#[test]
fn reference_resolves_a_small_example() {
    let p = placement(4);
    // Page 1 (slot 64) is rank 1's local page 0; page 5 (slot 323) its local page 1, row 3.
    let tokens = [0, 64, -1, 323, 5 * 64 + 63, 2 * 64];
    let got = resolve_owned(p, 1, ResolveMode::Tokens, &tokens, 1000).unwrap();
    assert_eq!(got.positions, [1, 3, 4]);
    assert_eq!(got.local, [0, 67, 127]);
    let pages = [1, 5, 2, -7, 9, 4];
    let got = resolve_owned(p, 1, ResolveMode::Pages, &pages, 10).unwrap();
    assert_eq!(got.positions, [0, 1, 4]);
    assert_eq!(got.local, [0, 1, 2]);
    let unsharded = resolve_owned(
        Placement::unsharded(),
        0,
        ResolveMode::Tokens,
        &tokens,
        1000,
    );
    assert_eq!(unsharded.unwrap().local, [0, 64, 323, 383, 128]);
}

#[test]
fn reference_partitions_the_entries_over_the_ranks() {
    let mut rng = common::rng("reference_partitions_the_entries_over_the_ranks");
    let input = entries(&mut rng, 5000);
    for shard in [1, 2, 3, 4, 8] {
        let p = placement(shard);
        for mode in MODES {
            let mut seen = vec![false; input.len()];
            for rank in 0..shard {
                let got = resolve_owned(p, rank, mode, &input, LIMIT).unwrap();
                assert!(
                    got.positions.windows(2).all(|w| w[0] < w[1]),
                    "stable order"
                );
                for (&i, &local) in got.positions.iter().zip(&got.local) {
                    assert!(!seen[i as usize], "entry {i} owned twice");
                    seen[i as usize] = true;
                    // The local index maps back to the entry on this rank.
                    let back = match mode {
                        ResolveMode::Tokens => {
                            p.logical(rank, LocalPage(local / 64)).unwrap().0 * 64 + local % 64
                        }
                        ResolveMode::Pages => p.logical(rank, LocalPage(local)).unwrap().0,
                    };
                    assert_eq!(back as i64, input[i as usize], "{mode:?} N={shard}");
                }
            }
            for (i, &e) in input.iter().enumerate() {
                assert_eq!(seen[i], e >= 0, "entry {i} ({e}) of {mode:?} N={shard}");
            }
        }
    }
}

#[test]
fn reference_rejects_out_of_range_entries_and_ranks() {
    let p = placement(2);
    let err = resolve_owned(p, 0, ResolveMode::Pages, &[1, -1, 10, 12], 10).unwrap_err();
    assert!(
        matches!(
            err,
            Error::OutOfRange {
                index: 10,
                limit: 10,
                ..
            }
        ),
        "{err}"
    );
    let err = resolve_owned(p, 2, ResolveMode::Pages, &[1], 10).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    let empty = resolve_owned(p, 1, ResolveMode::Tokens, &[], 0).unwrap();
    assert_eq!(empty, Resolved::default());
}

/// Every (N, rank, mode) over one input, on one resolver, against the reference.
fn matches_reference(b: &dyn Backend, input: &[i64]) {
    let n = input.len();
    let buf = upload_i64s_sync(b, input).unwrap();
    let mut resolver = Resolver::new(b, n).unwrap();
    for shard in SHARDS {
        let p = placement(shard);
        for rank in 0..shard {
            for mode in MODES {
                let expected = resolve_owned(p, rank, mode, input, LIMIT).unwrap();
                let got = run_device(b, &mut resolver, &buf, n, p, rank, mode, LIMIT);
                let want = Outputs::expected(&expected, n);
                assert!(
                    got == want,
                    "{}: n={n} N={shard} rank={rank} {mode:?}: {}",
                    b.name(),
                    got.diff(&want)
                );
                let safe = resolver
                    .resolve_sync(b, &buf, n, p, rank, mode, LIMIT)
                    .unwrap();
                assert!(safe == expected, "{}: safe resolve differs", b.name());
            }
        }
    }
}

// Every (N, rank, mode) of inputs around the tile size (1024) and of many tiles, on one
// resolver, against the reference.
common::on_cpu_and_gpu!(resolution_matches_the_reference, |device| {
    let (b, mut rng) = (device.stream(), device.rng());
    for n in [1, 1023, 1024, 1025, 2049, 10_000, 100_000] {
        matches_reference(b.as_ref(), &entries(&mut rng, n));
    }
});

#[test]
fn empty_resolution_launches_nothing() {
    let b = CpuBackend::new();
    let mut resolver = Resolver::new(&b, 16).unwrap();
    let input = upload_i64s_sync(&b, &[5; 16]).unwrap();
    b.fill(resolver.count_buffer(), POISON).unwrap();
    let got = resolver
        .resolve_sync(&b, &input, 0, placement(2), 1, ResolveMode::Tokens, 10)
        .unwrap();
    assert_eq!(got, Resolved::default());
    assert_eq!(
        b.read_sync(resolver.count_buffer(), 0, 8).unwrap(),
        [POISON; 8]
    );
    // The raw entry point leaves a count device consumers can read.
    // SAFETY: nothing is read from `entries` for n == 0; the resolver was made on `b`.
    unsafe {
        resolver
            .resolve_device(&b, 0, 0, placement(2), 1, ResolveMode::Tokens, 10)
            .unwrap()
    };
    b.synchronize().unwrap();
    assert_eq!(b.read_sync(resolver.count_buffer(), 0, 8).unwrap(), [0; 8]);
}

#[test]
fn resolver_arguments_are_checked() {
    let b = CpuBackend::new();
    for capacity in [0, 1 << 31] {
        assert!(matches!(
            Resolver::new(&b, capacity),
            Err(Error::InvalidArgument(_))
        ));
    }
    let mut resolver = Resolver::new(&b, 8).unwrap();
    assert_eq!(resolver.capacity(), 8);
    let input = upload_i64s_sync(&b, &[1; 10]).unwrap();
    let p = placement(4);
    let mode = ResolveMode::Pages;
    let misaligned = input.slice(4, 64).unwrap();
    let cases = [
        (
            "over capacity",
            resolver.resolve_sync(&b, &input, 9, p, 0, mode, 10),
        ),
        (
            "rank >= N",
            resolver.resolve_sync(&b, &input, 8, p, 4, mode, 10),
        ),
        (
            "short input",
            resolver.resolve_sync(&b, &input.slice(0, 56).unwrap(), 8, p, 0, mode, 10),
        ),
        (
            "misaligned input",
            resolver.resolve_sync(&b, &misaligned, 8, p, 0, mode, 10),
        ),
    ];
    for (what, got) in cases {
        assert!(
            matches!(got, Err(Error::InvalidArgument(_))),
            "{what}: {got:?}"
        );
    }
    // SAFETY: refused before anything is read: the address is not 8-byte aligned.
    let raw = unsafe { resolver.resolve_device(&b, misaligned.addr(), 8, p, 0, mode, 10) };
    assert!(matches!(raw, Err(Error::InvalidArgument(_))), "{raw:?}");
    // The checks consumed nothing: the resolver still works.
    let got = resolver
        .resolve_sync(&b, &input, 8, p, 1, mode, 10)
        .unwrap();
    assert_eq!(got.positions, (0..8).collect::<Vec<_>>());
}

// Entries over seven tiles with three out-of-range ones: the resolution is rejected naming
// the first (2100, exactly the limit), and the report is consumed with it.
common::on_cpu_and_gpu!(bad_entry_is_rejected, |device| {
    let b = device.stream();
    let b = b.as_ref();
    let mut input: Vec<i64> = (0..3 * 2048 + 100).map(|i| i % 1000).collect();
    for (at, value) in [(5000, 1001), (2100, 1000), (6000, i64::MAX)] {
        input[at] = value;
    }
    let err = resolve_owned(placement(2), 0, ResolveMode::Pages, &input, 1000).unwrap_err();
    assert!(
        matches!(err, Error::OutOfRange { index: 1000, .. }),
        "{err}"
    );
    let buf = upload_i64s_sync(b, &input).unwrap();
    let mut resolver = Resolver::new(b, input.len()).unwrap();
    let got = resolver.resolve_sync(
        b,
        &buf,
        input.len(),
        placement(2),
        0,
        ResolveMode::Pages,
        1000,
    );
    match got {
        Err(Error::KernelRejected { kernel, position }) => {
            let want = ("kvs_resolve_pages_pow2", 2100);
            assert_eq!((kernel, position), want, "{}", b.name())
        }
        other => panic!("{}: expected a rejection, got {other:?}", b.name()),
    }
    // The report is consumed: the next resolution of good entries succeeds.
    let good = resolver
        .resolve_sync(b, &buf, 2000, placement(2), 1, ResolveMode::Pages, 1000)
        .unwrap();
    assert_eq!(good.positions.len(), 1000, "{}", b.name());
});

/// 4M entries (4096 tiles, more than one wave) on the GPU, where the CPU twin is slow: checked
/// against the reference, which the twin matches (`cpu_resolution_matches_the_reference`), for
/// every rank of N = 4 and a few others; the twin runs once at this size too. Then short and
/// full launches on one tile state, and a resolver used with another address space.
#[test]
fn gpu_resolve_of_millions_of_entries_matches_the_reference() {
    let test = "gpu_resolve_of_millions_of_entries_matches_the_reference";
    let Some(gpu) = common::cuda(test) else {
        return;
    };
    let mut rng = common::rng(test);
    let cpu = CpuBackend::new();
    let n = 4 << 20;
    let input = entries(&mut rng, n);
    let buf = upload_i64s_sync(&gpu, &input).unwrap();
    let mut resolver = Resolver::new(&gpu, n).unwrap();
    let mut combos: Vec<(u32, u32)> = (0..4).map(|rank| (4, rank)).collect();
    combos.extend([(1, 0), (2, 1), (3, 2), (6, 5), (8, 7)]);
    for (shard, rank) in combos {
        for mode in MODES {
            let p = placement(shard);
            let expected = resolve_owned(p, rank, mode, &input, LIMIT).unwrap();
            let want = Outputs::expected(&expected, n);
            let got = run_device(&gpu, &mut resolver, &buf, n, p, rank, mode, LIMIT);
            assert!(
                got == want,
                "n={n} N={shard} rank={rank} {mode:?}: {}",
                got.diff(&want)
            );
            if (shard, rank, mode) == (8, 7, ResolveMode::Tokens) {
                let cpu_buf = upload_i64s_sync(&cpu, &input).unwrap();
                let mut cpu_resolver = Resolver::new(&cpu, n).unwrap();
                let twin = run_device(&cpu, &mut cpu_resolver, &cpu_buf, n, p, rank, mode, LIMIT);
                assert!(twin == want, "CPU twin at 4M: {}", twin.diff(&want));
            }
        }
    }
    // Short and full launches on the same tile state: each short one must clear every node the
    // full one before it used, or the next full launch would wait forever on stale nodes.
    let p = placement(4);
    for len in [2049, n, 1, n, 3000, n] {
        let expected = resolve_owned(p, 2, ResolveMode::Tokens, &input[..len], LIMIT).unwrap();
        let got = run_device(
            &gpu,
            &mut resolver,
            &buf,
            len,
            p,
            2,
            ResolveMode::Tokens,
            LIMIT,
        );
        let want = Outputs::expected(&expected, len);
        assert!(
            got == want,
            "{len} entries after other sizes: {}",
            got.diff(&want)
        );
    }
    // A resolver is tied to the address space it was made in.
    let mut cpu_resolver = Resolver::new(&cpu, 16).unwrap();
    let wrong = cpu_resolver.resolve_sync(&gpu, &buf, 16, p, 0, ResolveMode::Pages, LIMIT);
    assert!(
        matches!(wrong, Err(Error::ForeignMemory { .. })),
        "{wrong:?}"
    );
}

#[test]
fn scratch_reference_translates_and_refuses_bad_slots() {
    // Logical page 0 -> scratch page 2, page 1 unmapped, page 2 -> scratch page 0.
    let table = [2, -1, 0];
    let got = scratch_rows(&[5, -1, 2 * 64 + 63, 63], &table, 192).unwrap();
    assert_eq!(got, [2 * 64 + 5, -1, 63, 2 * 64 + 63]);
    type Case = (&'static [i64], u64, fn(&Error) -> bool);
    let cases: [Case; 4] = [
        (&[3 * 64], 192, |e| {
            matches!(
                e,
                Error::OutOfRange {
                    index: 192,
                    limit: 192,
                    ..
                }
            )
        }),
        (&[64], 192, |e| matches!(e, Error::InvalidArgument(_))),
        (&[5], 2 * 64 + 5, |e| {
            matches!(
                e,
                Error::OutOfRange {
                    index: 133,
                    limit: 133,
                    ..
                }
            )
        }),
        (&[0], 0, |e| matches!(e, Error::OutOfRange { .. })),
    ];
    for (slots, rows, expected) in cases {
        let err = scratch_rows(slots, &table, rows).unwrap_err();
        assert!(expected(&err), "{slots:?} with {rows} rows: {err}");
    }
    // A table entry whose row does not fit 64 bits is refused, not wrapped.
    let err = scratch_rows(&[0], &[1 << 58], u64::MAX).unwrap_err();
    assert!(matches!(err, Error::OutOfRange { .. }), "{err}");
}

/// Random mapped slots (padding ~10%) through `kvs_scratch_rows` against the reference.
fn scratch_matches_reference(b: &dyn Backend, rng: &mut impl Rng, n: usize) {
    let pages = n.div_ceil(64) + 3;
    // A random injective map onto scratch pages, leaving every third logical page unmapped.
    let mut table: Vec<i64> = common::synth::permutation(rng, pages);
    for (i, t) in table.iter_mut().enumerate() {
        if i % 3 == 1 {
            *t = -1;
        }
    }
    let slots: Vec<i64> = (0..n)
        .map(|_| loop {
            if rng.random_range(0..10) == 0 {
                break -1;
            }
            let slot = rng.random_range(0..pages as i64 * 64);
            if table[slot as usize / 64] >= 0 {
                break slot;
            }
        })
        .collect();
    let rows = pages as u64 * 64;
    let expected = scratch_rows(&slots, &table, rows).unwrap();
    let slot_buf = upload_i64s_sync(b, &slots).unwrap();
    let table_buf = upload_i64s_sync(b, &table).unwrap();
    let out = b.alloc(8 * n + 8, MemoryKind::Device).unwrap();
    b.fill(&out, POISON).unwrap();
    scratch_rows_device_sync(b, &slot_buf, n, &table_buf, pages, rows, &out).unwrap();
    let got = b.read_sync(&out, 0, out.len()).unwrap();
    assert!(
        i64s_from_bytes(&got[..8 * n]) == expected,
        "{}: n={n}",
        b.name()
    );
    assert_eq!(got[8 * n..], [POISON; 8], "{}: wrote past n", b.name());
}

/// A slot on an unmapped page: -1 for it, the rest written, the smallest position reported.
fn scratch_bad_slot_is_rejected(b: &dyn Backend) {
    // Page 3 maps to 2^58: its row would wrap around 64 bits into range if multiplied first.
    let table = upload_i64s_sync(b, &[1, -1, 0, 1 << 58]).unwrap();
    let slots = upload_i64s_sync(b, &[3, 130, 70, 64, -1, 197]).unwrap();
    let out = b.alloc(48, MemoryKind::Device).unwrap();
    b.fill(&out, POISON).unwrap();
    match scratch_rows_device_sync(b, &slots, 6, &table, 4, 128, &out) {
        Err(Error::KernelRejected { kernel, position }) => {
            assert_eq!((kernel, position), ("kvs_scratch_rows", 2), "{}", b.name())
        }
        other => panic!("{}: expected a rejection, got {other:?}", b.name()),
    }
    let got = i64s_from_bytes(&b.read_sync(&out, 0, 48).unwrap());
    assert_eq!(got, [67, 2, -1, -1, -1, -1], "{}", b.name());
}

// Scratch translation matches the reference for no, one and many slots, rejects a slot on an
// unmapped page, and refuses buffers shorter than the slots and table they must hold.
common::on_cpu_and_gpu!(scratch_translation_matches_the_reference, |device| {
    let (b, mut rng) = (device.stream(), device.rng());
    let b = b.as_ref();
    for n in [0, 1, 1000, 100_000] {
        scratch_matches_reference(b, &mut rng, n);
    }
    scratch_bad_slot_is_rejected(b);
    let small = b.alloc(8, MemoryKind::Device).unwrap();
    let err = scratch_rows_device_sync(b, &small, 2, &small, 1, 64, &small).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
});

/// Raw `kvs_resolve` parameters the tile state cannot serve are refused before anything runs.
#[test]
fn raw_launch_with_bad_tile_state_is_refused() {
    let b = CpuBackend::new();
    let input = upload_i64s_sync(&b, &[1; 2048]).unwrap();
    let outputs = b.alloc(12 * 2048 + 8, MemoryKind::Device).unwrap();
    let state = b.alloc(2 * 8 * 16, MemoryKind::Device).unwrap();
    let good = kvshard::abi::kvs_resolve_params {
        entries: input.addr(),
        num_entries: 2048,
        limit: 10,
        out_positions: outputs.addr(),
        out_local: outputs.addr() + 4 * 2048,
        out_count: outputs.addr() + 12 * 2048,
        tile_state: state.addr(),
        shard: 2,
        mode: kvshard::abi::KVS_RESOLVE_PAGES,
        state_tiles: 16,
        clear_tiles: 2,
        ..Default::default()
    };
    // SAFETY: every address above is a live CPU-backend buffer of the sizes the kernel needs.
    unsafe { b.resolve(good) }.unwrap();
    b.synchronize().unwrap();
    let bad = [
        (
            "parity 2",
            kvshard::abi::kvs_resolve_params { parity: 2, ..good },
        ),
        (
            "trees smaller than the tiles",
            kvshard::abi::kvs_resolve_params {
                num_entries: 17 * 1024,
                ..good
            },
        ),
        (
            "clearing past the tree",
            kvshard::abi::kvs_resolve_params {
                clear_tiles: 17,
                ..good
            },
        ),
        (
            "trees not in whole lines",
            kvshard::abi::kvs_resolve_params {
                state_tiles: 8,
                ..good
            },
        ),
    ];
    for (what, p) in bad {
        // SAFETY: refused by the parameter check before any address is used.
        let got = unsafe { b.resolve(p) };
        assert!(
            matches!(got, Err(Error::InvalidArgument(_))),
            "{what}: {got:?}"
        );
    }
}
