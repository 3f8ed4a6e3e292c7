//! Shape and launch checks, the tile heuristic, the gate/up row order (no GPU).

use super::*;

#[test]
fn gemm_shapes_are_checked() {
    assert!(check_gemm_shape(8, 2880, 2880).is_ok());
    assert!(check_gemm_shape(256, 4096, 7168).is_ok());
    for (e, n, k) in [(0, 64, 64), (1025, 64, 64), (1, 100, 64), (1, 64, 32), (1, 0, 64), (1, 64, 2880 + 16)] {
        assert!(matches!(check_gemm_shape(e, n, k), Err(Error::InvalidShape(_))), "{e} {n} {k}");
    }
}

#[test]
fn tile_heuristic() {
    // At most 8 rows in all: no expert can have more than 8.
    assert_eq!(GemmTile::choose(8, 256), GemmTile::M128N8);
    assert_eq!(GemmTile::choose(2, 8), GemmTile::M128N8);
    assert_eq!(GemmTile::choose(1, 1), GemmTile::M128N8);
    assert_eq!(GemmTile::choose(9, 256), GemmTile::M128N16);
    assert_eq!(GemmTile::choose(9, 1), GemmTile::M128N16);
    assert_eq!(GemmTile::choose(16 * 256, 256), GemmTile::M128N16);
    assert_eq!(GemmTile::choose(65536, 256), GemmTile::M128N256);
    assert_eq!(GemmTile::choose(2048, 8), GemmTile::M128N256);
    assert_eq!(GemmTile::choose(128 * 256, 256), GemmTile::M128N128);
    assert_eq!(GemmTile::choose(128 * 256 + 1, 256), GemmTile::M128N256);
    assert_eq!(GemmTile::choose(17 * 256, 256), GemmTile::M128N32);
    assert_eq!(GemmTile::choose(8192, 256), GemmTile::M128N32);
    assert_eq!(GemmTile::choose(32 * 8 + 1, 8), GemmTile::M128N64);
    assert_eq!(GemmTile::choose(64 * 128, 128), GemmTile::M128N64);
    assert_eq!(GemmTile::choose(64 * 128 + 1, 128), GemmTile::M128N128);
}

#[test]
fn launch_tile_takes_the_warp_kernel_for_at_most_8_rows() {
    use GemmEpilogue::{Interleaved, Plain, SwigluBf16, SwigluNvfp4};
    let warp = GemmTile::WarpM16N8;
    if std::env::var("NVFP4MOE_WARP_KERNEL").as_deref() == Ok("0") {
        eprintln!("NVFP4MOE_WARP_KERNEL=0: kAuto keeps the N8 tile; not checked");
        return;
    }
    let tile = |rows, e, n, k, ep, inv| launch_tile(GemmTile::Auto, rows, e, n, k, ep, inv, 132);
    // T = 1 on 132 SMs (264 N8 slots): deepseek-v3's L2 (448 N8 tiles), qwen3-30b-a3b's L1 (96),
    // mixtral-8x7b's L2 (64, K = 14336, 2 rows), a lone row at K = 64.
    for (rows, e, n, k, ep) in [
        (8, 256, 7168, 2048, Plain),
        (8, 128, 1536, 2048, SwigluBf16),
        (2, 8, 4096, 14336, Plain),
        (1, 8, 128, 64, Interleaved),
    ] {
        assert_eq!(tile(rows, e, n, k, ep, false), warp, "{rows} {e} {n} {k} {ep:?}");
        // Batch-invariant plans and SwigluNvfp4 keep the N8 tile.
        assert_eq!(tile(rows, e, n, k, ep, true), GemmTile::M128N8);
        assert_eq!(tile(rows, e, n, k, SwigluNvfp4, false), GemmTile::M128N8);
    }
    // N8 filling one round (deepseek-v3 L1 at T = 1: 256 tiles on 264 slots) or more than two
    // (mixtral-8x7b L1 at T = 4: 1792) keeps N8; on 160 SMs deepseek-v3's 256 no longer fill a round.
    assert_eq!(tile(8, 256, 4096, 7168, SwigluBf16, false), GemmTile::M128N8);
    assert_eq!(tile(8, 8, 28672, 4096, SwigluBf16, false), GemmTile::M128N8);
    assert_eq!(launch_tile(GemmTile::Auto, 8, 256, 4096, 7168, SwigluBf16, false, 160), warp);
    // x too large for shared memory (8 rows: K up to 9344 beside 16 five-slot rings, the deepest
    // that ring_choice picks), or more than 8 rows.
    assert_eq!(tile(8, 256, 7168, 9344, Plain, false), warp);
    assert_eq!(tile(8, 256, 7168, 9408, Plain, false), GemmTile::M128N8);
    assert_eq!(tile(9, 256, 7168, 2048, Plain, false), GemmTile::M128N16);
    // An explicit tile is the launch's tile.
    assert_eq!(launch_tile(GemmTile::M128N8, 8, 256, 7168, 2048, Plain, false, 132), GemmTile::M128N8);
    assert_eq!(launch_tile(warp, 8, 256, 7168, 2048, Plain, true, 132), warp);
    // The core rejects an explicit warp tile it cannot run, before any launch.
    let args = |rows: i64, k: i64, epilogue| GroupedGemmArgs {
        experts: 8,
        n: 256,
        k,
        total_rows: rows,
        tile: warp,
        epilogue,
        ..Default::default()
    };
    let ok = |a: &GroupedGemmArgs| launch::status(raw::grouped_gemm_nvfp4_can_implement(a)).is_ok();
    assert!(ok(&args(8, 7168, Plain)));
    assert!(ok(&args(0, 7168, Plain)));
    for bad in [args(9, 64, Plain), args(8, 14336, Plain), args(1, 64, SwigluNvfp4)] {
        assert!(!ok(&bad), "{:?}", (bad.total_rows, bad.k, bad.epilogue));
    }
}

#[test]
fn launches_are_checked_before_any_kernel() {
    let b = |addr: u64, len: usize| BufferInfo { addr, len };
    let (e, k, n, rows) = (8usize, 256usize, 128usize, 37usize);
    let (x, out) = (b(0x1000, rows * k), b(0x9000, rows * n));
    assert!(check_gemm_launch(e, k, n, rows, x, e + 1, out).is_ok());
    assert!(check_gemm_launch(e, k, n, 0, b(0, 0), e + 1, b(0, 0)).is_ok());
    let cases = [
        (check_gemm_launch(e, k, n, rows, b(0x1000, rows * k - 1), e + 1, out), "x"),
        (check_gemm_launch(e, k, n, rows, x, e + 1, b(0x9000, rows * n - 1)), "out"),
    ];
    for (r, name) in cases {
        match r {
            Err(Error::BufferTooSmall { name: got, .. }) => assert_eq!(got, name),
            other => panic!("{name}: {other:?}"),
        }
    }
    assert!(matches!(check_gemm_launch(e, k, n, rows, x, e, out), Err(Error::InvalidShape(_))));
    assert!(matches!(
        check_gemm_launch(e, k, n, rows, b(0x1008, rows * k), e + 1, out),
        Err(Error::Misaligned { name: "x", .. })
    ));
    assert!(matches!(
        check_gemm_launch(e, k, n, rows, x, e + 1, b(0x9002, rows * n)),
        Err(Error::Misaligned { name: "out", .. })
    ));
    assert!(matches!(check_gemm_launch(e, k, n, 1 << 31, x, e + 1, out), Err(Error::InvalidShape(_))));
}

#[test]
fn gate_up_order_is_a_permutation_of_bands() {
    let n = 2 * 2880;
    let mut seen = vec![false; n];
    for p in 0..n {
        let src = gate_up_source_row(p, n);
        assert!(!seen[src], "row {src} twice");
        seen[src] = true;
        // Within a band of 16, rows r and r + 8 are the gate and up rows of one feature.
        if p % 16 < 8 {
            assert_eq!(gate_up_source_row(p + 8, n), src + n / 2);
        }
    }
    assert!(seen.iter().all(|&s| s));
    assert_eq!(gate_up_source_row(0, 64), 0);
    assert_eq!(gate_up_source_row(8, 64), 32);
    assert_eq!(gate_up_source_row(17, 64), 9);
    assert_eq!(gate_up_source_row(31, 64), 32 + 15);
}

#[test]
fn prepared_size_matches_the_chunk_layout() {
    assert_eq!(raw::core_prepared_weight_bytes(2, 128, 256) as usize, 2 * 2 * 4 * 2304);
    assert_eq!(raw::core_prepared_weight_bytes(1, 100, 256), 0);
}
