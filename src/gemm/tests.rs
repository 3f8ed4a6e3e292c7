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
    assert_eq!(GemmTile::choose(65536, 256), GemmTile::M128N128);
    assert_eq!(GemmTile::choose(2048, 8), GemmTile::M128N128);
    assert_eq!(GemmTile::choose(17 * 256, 256), GemmTile::M128N32);
    assert_eq!(GemmTile::choose(8192, 256), GemmTile::M128N32);
    assert_eq!(GemmTile::choose(32 * 8 + 1, 8), GemmTile::M128N64);
    assert_eq!(GemmTile::choose(64 * 128, 128), GemmTile::M128N64);
    assert_eq!(GemmTile::choose(64 * 128 + 1, 128), GemmTile::M128N128);
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
