//! Where each block scale lives: the linear `[rows, K/16]` layout checkpoints store, the
//! swizzled "128x4" layout Blackwell block-scaled MMA and the TensorRT-LLM / FlashInfer / vLLM
//! activation quantizers produce, and the grouped per-expert form of the swizzled layout.
//!
//! All offsets are pure index arithmetic (no allocation) so the CUDA kernels can mirror them;
//! shapes are validated by the callers (see [`crate::host::validate_quantize_shape`]), which
//! bound them so that no product here overflows. Given sizes beyond that, the arithmetic
//! overflows (a panic in debug builds, a wrapped value in release ones): validate first.

use crate::error::{Error, Result};

/// How the E4M3 block scales are laid out: declared in `cpp/include/nvfp4moe/types.h`, generated.
pub use crate::abi::ScaleLayout;

impl ScaleLayout {
    /// The canonical lower-case name (`parse` accepts it back).
    pub fn name(self) -> &'static str {
        match self {
            ScaleLayout::Linear => "linear",
            ScaleLayout::Swizzled128x4 => "swizzled128x4",
        }
    }

    /// Parses `linear`, or `swizzled` / `128x4` / `swizzled128x4` (case-insensitive).
    ///
    /// # Errors
    /// [`Error::UnsupportedLayout`] for any other name.
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "linear" => Ok(ScaleLayout::Linear),
            "swizzled" | "128x4" | "swizzled128x4" => Ok(ScaleLayout::Swizzled128x4),
            other => Err(Error::UnsupportedLayout(format!(
                "`{other}` (expected `linear`, `swizzled`, `128x4` or `swizzled128x4`)"
            ))),
        }
    }
}

impl std::fmt::Display for ScaleLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ScaleLayout {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        ScaleLayout::parse(s)
    }
}

/// Rows of one swizzled tile.
pub const SWIZZLE_TILE_ROWS: usize = 128;
/// Scale columns of one swizzled tile.
pub const SWIZZLE_TILE_COLS: usize = 4;
/// Elements per block (one scale each).
pub const BLOCK_SIZE: usize = 16;

#[inline]
fn round_up(x: usize, multiple: usize) -> usize {
    x.div_ceil(multiple) * multiple
}

/// Block scales per row: `cols / 16`.
#[inline]
pub fn scale_cols(cols: usize) -> usize {
    cols / BLOCK_SIZE
}

/// Number of 4-column tiles of scale columns: `ceil((cols/16)/4)` (the `kTiles` of NVFP4.md).
#[inline]
pub fn swizzled_k_tiles(cols: usize) -> usize {
    scale_cols(cols).div_ceil(SWIZZLE_TILE_COLS)
}

/// Bytes of scales for a `[rows, cols]` tensor, padding included.
#[inline]
pub fn scale_len(layout: ScaleLayout, rows: usize, cols: usize) -> usize {
    match layout {
        ScaleLayout::Linear => rows * scale_cols(cols),
        ScaleLayout::Swizzled128x4 => round_up(rows, SWIZZLE_TILE_ROWS) * round_up(scale_cols(cols), SWIZZLE_TILE_COLS),
    }
}

/// Offset of the scale of row `m`, scale column `k` in the 128x4 swizzled layout, where
/// `k_tiles = ceil((cols/16)/4)`. Each 128x4 tile is 512 contiguous bytes; inside it, row `m`
/// sits at `(m%32)*16 + ((m%128)/32)*4`, which is what the MMA's scale-factor load expects.
#[inline]
pub fn swizzled_offset(m: usize, k: usize, k_tiles: usize) -> usize {
    (m / 128) * (k_tiles * 512) + (k / 4) * 512 + (m % 32) * 16 + ((m % 128) / 32) * 4 + (k % 4)
}

/// Offset of the scale of row `m`, scale column `k` of a `[rows, cols]` tensor in `layout`.
/// `rows` only matters for the linear layout's bounds (debug-checked).
#[inline]
pub fn scale_offset(layout: ScaleLayout, rows: usize, cols: usize, m: usize, k: usize) -> usize {
    debug_assert!(m < rows && k < scale_cols(cols), "scale ({m}, {k}) outside [{rows}, {cols}/16]");
    match layout {
        ScaleLayout::Linear => m * scale_cols(cols) + k,
        ScaleLayout::Swizzled128x4 => swizzled_offset(m, k, swizzled_k_tiles(cols)),
    }
}

/// First scale row of expert `expert`'s region in a grouped swizzled buffer, where `row_offset`
/// is the expert's first permuted row: `floor((row_offset + expert*127)/128)*128`
/// (TensorRT-LLM's `getOffsetActivationSF`). Each region starts on a 128-row tile and regions
/// never overlap, whatever the expert sizes.
#[inline]
pub fn grouped_region_start_row(row_offset: usize, expert: usize) -> usize {
    (row_offset + expert * (SWIZZLE_TILE_ROWS - 1)) / SWIZZLE_TILE_ROWS * SWIZZLE_TILE_ROWS
}

/// Scale rows a grouped swizzled buffer needs: `round_up(total_rows + E*127, 128)`.
#[inline]
pub fn grouped_scale_rows(total_rows: usize, num_experts: usize) -> usize {
    round_up(total_rows + num_experts * (SWIZZLE_TILE_ROWS - 1), SWIZZLE_TILE_ROWS)
}

/// Bytes of a grouped swizzled scale buffer, padding included.
#[inline]
pub fn grouped_scale_len(total_rows: usize, num_experts: usize, cols: usize) -> usize {
    grouped_scale_rows(total_rows, num_experts) * round_up(scale_cols(cols), SWIZZLE_TILE_COLS)
}

/// Checks per-expert row offsets (length E+1): first 0, nondecreasing, last `total_rows`.
///
/// # Errors
/// [`Error::InvalidShape`] naming the first offset that breaks a rule.
pub fn validate_expert_offsets(expert_offsets: &[i32], total_rows: usize) -> Result<()> {
    let (first, last) = match (expert_offsets.first(), expert_offsets.last()) {
        (Some(&first), Some(&last)) if expert_offsets.len() >= 2 => (first, last),
        _ => {
            return Err(Error::InvalidShape(format!(
                "expert offsets need E+1 >= 2 entries, got {}",
                expert_offsets.len()
            )))
        }
    };
    if first != 0 {
        return Err(Error::InvalidShape(format!("expert offsets must start at 0, got {first}")));
    }
    if let Some(e) = expert_offsets.windows(2).position(|w| w[1] < w[0]) {
        return Err(Error::InvalidShape(format!(
            "expert offsets must be nondecreasing: offsets[{}] = {} > offsets[{}] = {}",
            e,
            expert_offsets[e],
            e + 1,
            expert_offsets[e + 1]
        )));
    }
    if usize::try_from(last).ok() != Some(total_rows) {
        return Err(Error::InvalidShape(format!("expert offsets end at {last}, but there are {total_rows} rows")));
    }
    Ok(())
}

/// Expert that permuted row `row` belongs to: the last `e` with `expert_offsets[e] <= row`
/// (empty experts, whose offsets repeat, are skipped). Offsets must be validated and
/// `row < total_rows`.
#[inline]
pub fn expert_of_row(expert_offsets: &[i32], row: usize) -> usize {
    let passed = expert_offsets.partition_point(|&o| o as usize <= row);
    debug_assert!(passed >= 1 && passed < expert_offsets.len(), "row {row} outside the experts");
    passed.saturating_sub(1)
}

/// Offset of the scale of permuted row `row`, scale column `k` in a grouped swizzled buffer of
/// a `[total_rows, cols]` activation: the row's expert region start plus its row within the
/// expert, swizzled. `expert_offsets` must pass [`validate_expert_offsets`] and `row` must be
/// below its last entry.
///
/// # Panics
/// On an empty `expert_offsets` (which [`validate_expert_offsets`] refuses).
#[inline]
pub fn grouped_swizzled_offset(expert_offsets: &[i32], row: usize, k: usize, cols: usize) -> usize {
    let expert = expert_of_row(expert_offsets, row);
    let row_offset = expert_offsets[expert] as usize;
    let start = grouped_region_start_row(row_offset, expert);
    swizzled_offset(start + (row - row_offset), k, swizzled_k_tiles(cols))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    const ODD_ROWS: [usize; 7] = [0, 1, 127, 128, 129, 300, 513];
    const ODD_COLS: [usize; 6] = [16, 48, 64, 80, 144, 7168];

    #[test]
    fn layout_names_parse_back() {
        for layout in [ScaleLayout::Linear, ScaleLayout::Swizzled128x4] {
            assert_eq!(ScaleLayout::parse(layout.name()).unwrap(), layout);
            assert_eq!(layout.name().parse::<ScaleLayout>().unwrap(), layout);
        }
        assert_eq!(ScaleLayout::parse("swizzled").unwrap(), ScaleLayout::Swizzled128x4);
        assert_eq!(ScaleLayout::parse("128x4").unwrap(), ScaleLayout::Swizzled128x4);
        assert_eq!(ScaleLayout::parse("Linear").unwrap(), ScaleLayout::Linear);
        assert!(ScaleLayout::parse("").is_err());
        assert!(ScaleLayout::parse("4x128").is_err());
        assert_eq!(ScaleLayout::Linear as u32, 0);
        assert_eq!(ScaleLayout::Swizzled128x4 as u32, 1);
    }

    #[test]
    fn scale_len_pads_swizzled_only() {
        // (rows, cols, linear, swizzled), worked by hand.
        let cases = [
            (1, 16, 1, 128 * 4),
            (127, 48, 127 * 3, 128 * 4),
            (129, 80, 129 * 5, 256 * 8),
            (300, 16, 300, 384 * 4),
            (128, 64, 128 * 4, 128 * 4),
            (1, 7168, 448, 128 * 448),
            (300, 7168, 300 * 448, 384 * 448),
            (0, 48, 0, 0),
        ];
        for (rows, cols, linear, swizzled) in cases {
            assert_eq!(scale_len(ScaleLayout::Linear, rows, cols), linear, "{rows}x{cols}");
            assert_eq!(scale_len(ScaleLayout::Swizzled128x4, rows, cols), swizzled, "{rows}x{cols}");
        }
        assert_eq!(scale_cols(7168), 448);
        assert_eq!(swizzled_k_tiles(80), 2);
        assert_eq!(swizzled_k_tiles(64), 1);
    }

    #[test]
    fn swizzled_offsets_hand_picked() {
        // Written out from the definition: tile (m/128, k/4) of 512 bytes; inside it
        // 16 bytes per row of 32, 4 bytes per 32-row group, 1 byte per scale column.
        let k_tiles = 3; // cols = 16*12 = 192, or 16*9 = 144 padded to 12 scale columns
        assert_eq!(swizzled_offset(0, 0, k_tiles), 0);
        assert_eq!(swizzled_offset(0, 1, k_tiles), 1);
        assert_eq!(swizzled_offset(0, 4, k_tiles), 512);
        assert_eq!(swizzled_offset(1, 0, k_tiles), 16);
        assert_eq!(swizzled_offset(32, 0, k_tiles), 4);
        assert_eq!(swizzled_offset(33, 2, k_tiles), 16 + 4 + 2);
        assert_eq!(swizzled_offset(127, 3, k_tiles), 31 * 16 + 3 * 4 + 3);
        assert_eq!(swizzled_offset(128, 0, k_tiles), 3 * 512);
        // m = 300 = 2*128 + 44: tile row 2, 44 % 32 = 12, 44 / 32 = 1; k = 9 = 2*4 + 1.
        assert_eq!(swizzled_offset(300, 9, k_tiles), 2 * 1536 + 2 * 512 + 12 * 16 + 4 + 1);
        assert_eq!(scale_offset(ScaleLayout::Swizzled128x4, 301, 144, 300, 8), 2 * 1536 + 1024 + 196);
        assert_eq!(scale_offset(ScaleLayout::Linear, 301, 144, 300, 8), 300 * 9 + 8);
    }

    #[test]
    fn swizzled_offset_is_a_bijection_onto_scale_len() {
        for rows in ODD_ROWS {
            for cols in ODD_COLS {
                let len = scale_len(ScaleLayout::Swizzled128x4, rows, cols);
                let k_tiles = swizzled_k_tiles(cols);
                let padded_rows = rows.div_ceil(128) * 128;
                let padded_k = scale_cols(cols).div_ceil(4) * 4;
                let mut seen = vec![false; len];
                for m in 0..padded_rows {
                    for k in 0..padded_k {
                        let off = swizzled_offset(m, k, k_tiles);
                        assert!(off < len, "{rows}x{cols}: ({m},{k}) -> {off} >= {len}");
                        assert!(!seen[off], "{rows}x{cols}: ({m},{k}) -> {off} twice");
                        seen[off] = true;
                    }
                }
                assert_eq!(padded_rows * padded_k, len);
                assert!(seen.iter().all(|&s| s), "{rows}x{cols}: not onto");
            }
        }
    }

    #[test]
    fn linear_offset_is_row_major() {
        for rows in [1usize, 127, 129, 300] {
            for cols in [16usize, 48, 80] {
                let mut seen = HashSet::new();
                for m in 0..rows {
                    for k in 0..scale_cols(cols) {
                        let off = scale_offset(ScaleLayout::Linear, rows, cols, m, k);
                        assert_eq!(off, m * (cols / 16) + k);
                        assert!(seen.insert(off));
                    }
                }
                assert_eq!(seen.len(), scale_len(ScaleLayout::Linear, rows, cols));
            }
        }
    }

    #[test]
    fn validate_expert_offsets_rejects_bad_offsets() {
        assert!(validate_expert_offsets(&[0, 3, 3, 10], 10).is_ok());
        assert!(validate_expert_offsets(&[0, 0], 0).is_ok());
        assert!(validate_expert_offsets(&[], 0).is_err());
        assert!(validate_expert_offsets(&[0], 0).is_err());
        assert!(validate_expert_offsets(&[1, 3, 10], 10).is_err());
        assert!(validate_expert_offsets(&[0, 5, 4, 10], 10).is_err());
        assert!(validate_expert_offsets(&[0, 3, 9], 10).is_err());
        assert!(validate_expert_offsets(&[0, -1, 10], 10).is_err());
        assert!(validate_expert_offsets(&[0, 3, 11], 10).is_err());
    }

    #[test]
    fn grouped_regions_never_overlap() {
        let mut rng = crate::testing::test_rng();
        let seed = rng.seed();
        for trial in 0..200 {
            let num_experts = 1 + rng.below(9) as usize;
            let cols = 16 * (1 + rng.below(20) as usize);
            // Expert sizes: many empty ones, some crossing 128-row tiles.
            let mut offsets = vec![0i32];
            for _ in 0..num_experts {
                let n = match rng.below(4) {
                    0 => 0,
                    1 => rng.below(4),
                    2 => 120 + rng.below(20),
                    _ => rng.below(400),
                };
                offsets.push(offsets.last().unwrap() + n as i32);
            }
            let total = *offsets.last().unwrap() as usize;
            validate_expert_offsets(&offsets, total).unwrap();
            let len = grouped_scale_len(total, num_experts, cols);
            assert_eq!(len % 512, 0);
            let padded_k = scale_cols(cols).div_ceil(4) * 4;
            let mut owner = vec![usize::MAX; len];
            for e in 0..num_experts {
                let row_offset = offsets[e] as usize;
                let n = (offsets[e + 1] - offsets[e]) as usize;
                let start = grouped_region_start_row(row_offset, e);
                assert_eq!(start % 128, 0, "seed {seed:#x} trial {trial}");
                // The expert's whole padded region (its rows rounded up to 128).
                for local in 0..n.div_ceil(128) * 128 {
                    for k in 0..padded_k {
                        let off = swizzled_offset(start + local, k, swizzled_k_tiles(cols));
                        assert!(off < len, "seed {seed:#x} trial {trial}: expert {e} off {off}");
                        assert_eq!(
                            owner[off],
                            usize::MAX,
                            "seed {seed:#x} trial {trial}: experts {} and {e} overlap",
                            owner[off]
                        );
                        owner[off] = e;
                    }
                }
                // Real rows map through grouped_swizzled_offset to the same place.
                for local in 0..n {
                    for k in [0, scale_cols(cols) - 1] {
                        assert_eq!(
                            grouped_swizzled_offset(&offsets, row_offset + local, k, cols),
                            swizzled_offset(start + local, k, swizzled_k_tiles(cols)),
                            "seed {seed:#x} trial {trial}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn grouped_hand_worked() {
        // Experts of 3, 0, 130 and 1 rows; offsets 0, 3, 3, 133, 134.
        // Region starts: floor((0+0)/128)*128 = 0; expert 1 empty; expert 2:
        // floor((3 + 254)/128)*128 = 256; expert 3: floor((133 + 381)/128)*128 = 512.
        let offsets = [0, 3, 3, 133, 134];
        assert_eq!(grouped_region_start_row(0, 0), 0);
        assert_eq!(grouped_region_start_row(3, 2), 256);
        assert_eq!(grouped_region_start_row(133, 3), 512);
        // Rows: round_up(134 + 4*127, 128) = round_up(642, 128) = 768.
        assert_eq!(grouped_scale_rows(134, 4), 768);
        assert_eq!(grouped_scale_len(134, 4, 48), 768 * 4);
        assert_eq!(expert_of_row(&offsets, 2), 0);
        assert_eq!(expert_of_row(&offsets, 3), 2);
        assert_eq!(expert_of_row(&offsets, 132), 2);
        assert_eq!(expert_of_row(&offsets, 133), 3);
        // Row 132 is expert 2's local row 129 -> scale row 385: tile 3, 129 % 32 = 1, group 0.
        assert_eq!(grouped_swizzled_offset(&offsets, 132, 1, 48), 3 * 512 + 16 + 1);
        assert_eq!(grouped_swizzled_offset(&offsets, 133, 0, 48), 4 * 512);
    }
}
