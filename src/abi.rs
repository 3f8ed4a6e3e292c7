//! The types shared with the C++ core: generated at build time from
//! `cpp/include/nvfp4moe/types.h`, their one declaration (see `codegen/abi.rs`).
//!
//! The constants, the status codes and the enums ([`ScaleLayout`], [`RowOrder`], [`GemmTile`],
//! [`GemmEpilogue`], [`GroupedSource`]) are here with or without the `cuda` feature; with it, also
//! the `#[repr(C)]` launch argument structs (`*Args`) that the bridge hands to the core as they are.
//! A change to a value or a field in the header changes this module in the same build, and the
//! generated layout is asserted by rustc and, in `abi_check.cc`, by the C++ compiler; the `drift`
//! tests below show that a value or field changed on one side only fails that check.

#![allow(clippy::derivable_impls)]

include!(concat!(env!("OUT_DIR"), "/abi_types.rs"));

#[cfg(feature = "cuda")]
include!(concat!(env!("OUT_DIR"), "/abi_structs.rs"));

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_the_headers() {
        assert_eq!(ScaleLayout::Linear as i32, 0);
        assert_eq!(ScaleLayout::Swizzled128x4 as i32, 1);
        assert_eq!(GemmTile::M128N64 as i32, 3);
        assert_eq!(GemmTile::M128N32 as i32, 4);
        assert_eq!(GemmTile::M128N8 as i32, 5);
        assert_eq!(GemmEpilogue::SwigluNvfp4 as i32, 3);
        assert_eq!(Status::from_raw(6), Some(Status::CudaError));
        assert_eq!(Status::from_raw(9), Some(Status::OutOfMemory));
        assert_eq!(Status::from_raw(10), None);
        assert_eq!(RowOrder::GateUpBands8.cxx_name(), "kGateUpBands8");
        assert_eq!(EXPERT_LIMIT, 1024);
        assert_eq!(TOP_K_LIMIT, 32);
    }

    /// The core's version (version.h, which CMake's project version and the shared library's
    /// SONAME come from) is the crate's.
    #[test]
    fn the_core_version_is_the_crates() {
        let header = include_str!("../cpp/include/nvfp4moe/version.h");
        let part = |name: &str| {
            let prefix = format!("#define NVFP4MOE_VERSION_{name} ");
            let line = header.lines().find_map(|l| l.strip_prefix(prefix.as_str()));
            line.unwrap_or_else(|| panic!("version.h has no {prefix}")).trim().to_string()
        };
        let core = format!("{}.{}.{}", part("MAJOR"), part("MINOR"), part("PATCH"));
        assert_eq!(core, env!("CARGO_PKG_VERSION"), "cpp/include/nvfp4moe/version.h and Cargo.toml disagree");
    }
}

/// A build check: the generated C++ checks reject a header that drifted from the Rust side.
#[cfg(test)]
mod drift {
    // The FFI types have one root, `cpp/include/nvfp4moe/types.h`; the Rust side is generated from it
    // by `codegen/abi.rs` at build time, together with C++ `static_assert`s of the layout and values
    // the Rust side was generated with (compiled into the bridge). This test shows those checks bite:
    // the checks generated from the real header compile against it, and fail against a header where
    // one value or one field changed without the Rust side being regenerated. Those tests need a C++
    // compiler (`CXX`, else `c++`), not CUDA; the Python enum's test below reads files only.

    use crate::codegen_abi as abi;

    use std::path::{Path, PathBuf};
    use std::process::Command;

    fn header() -> String {
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("cpp/include/nvfp4moe/types.h")).unwrap()
    }

    /// Compiles the checks generated from `generated_from` against `header` (C++17, syntax only).
    fn compile(dir: &Path, generated_from: &str, header: &str) -> (bool, String) {
        let inc = dir.join("include/nvfp4moe");
        std::fs::create_dir_all(&inc).unwrap();
        std::fs::write(inc.join("types.h"), header).unwrap();
        let parsed = abi::parse(generated_from).unwrap();
        let check = dir.join("abi_check.cc");
        std::fs::write(&check, abi::cxx_checks(&parsed, "nvfp4moe/types.h")).unwrap();
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let out = Command::new(&cxx)
            .args(["-std=c++17", "-fsyntax-only", "-I"])
            .arg(dir.join("include"))
            .arg(&check)
            .output()
            .unwrap_or_else(|e| panic!("running {cxx}: {e}"));
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    }

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("nvfp4moe-abi-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn generated_checks_accept_the_header_they_came_from() {
        let h = header();
        let (ok, err) = compile(&scratch("same"), &h, &h);
        assert!(ok, "{err}");
    }

    #[test]
    fn a_changed_value_or_field_on_one_side_breaks_the_build() {
        let h = header();
        let edits: [(&str, &str, &str); 5] = [
            (
                "an enumerator value",
                "NVFP4MOE_ENUMERATOR(ScaleLayout, kSwizzled128x4, 1)",
                "NVFP4MOE_ENUMERATOR(ScaleLayout, kSwizzled128x4, 2)",
            ),
            (
                "a status code",
                "NVFP4MOE_ENUMERATOR(Status, kCudaError, 6)",
                "NVFP4MOE_ENUMERATOR(Status, kCudaError, 7)",
            ),
            ("a field's type", "  int64_t total_rows NVFP4MOE_INIT();", "  int32_t total_rows NVFP4MOE_INIT();"),
            (
                "a new field",
                "  int64_t num_act_decode_scales NVFP4MOE_INIT();",
                "  int64_t num_act_decode_scales NVFP4MOE_INIT();\n  int64_t padding NVFP4MOE_INIT();",
            ),
            ("a constant", "NVFP4MOE_CONST(kExpertLimit, 1024);", "NVFP4MOE_CONST(kExpertLimit, 2048);"),
        ];
        for (i, (what, from, to)) in edits.iter().enumerate() {
            assert!(h.contains(from), "the header no longer has `{from}`: update this test");
            let drifted = h.replacen(from, to, 1);
            let (ok, err) = compile(&scratch(&format!("drift{i}")), &h, &drifted);
            assert!(!ok, "{what}: the stale Rust side's checks still compiled");
            assert!(err.contains("static assert") || err.contains("static_assert"), "{what}: {err}");
            // Regenerated from the edited header, the two sides agree again.
            let (ok, err) = compile(&scratch(&format!("regen{i}")), &drifted, &drifted);
            assert!(ok, "{what}, regenerated: {err}");
        }
    }

    #[test]
    fn the_grammar_is_enforced() {
        let h = header();
        let bad = h.replacen("  int64_t rows NVFP4MOE_INIT();", "  size_t rows NVFP4MOE_INIT();", 1);
        assert!(abi::parse(&bad).unwrap_err().contains("unknown field type"));
        let bad = h.replacen("NVFP4MOE_ENUMERATOR(GemmTile, kAuto, 0)", "kAuto = 0", 1);
        assert!(abi::parse(&bad).is_err());
    }

    /// The Python package's `Tile` (python/nvfp4_moe/layer.py) is written by hand: it must name every
    /// `GemmTile` of the header with its value (`kWarpM16N8` -> `WARP_M16N8`), and nothing else.
    #[test]
    fn python_tile_enum_matches_the_header() {
        let parsed = abi::parse(&header()).unwrap();
        let tile = parsed.enums.iter().find(|e| e.name == "GemmTile").expect("GemmTile in types.h");
        let python_name = |variant: &str| {
            let v = variant.strip_prefix('k').unwrap_or(variant);
            let mut out = String::new();
            for (i, c) in v.char_indices() {
                // A word starts at an upper-case letter after a lower-case one ("WarpM16" -> "WARP_M16").
                if i > 0 && c.is_ascii_uppercase() && v[..i].ends_with(|p: char| p.is_ascii_lowercase()) {
                    out.push('_');
                }
                out.push(c.to_ascii_uppercase());
            }
            out
        };
        let mut want: Vec<(String, i64)> = tile.variants.iter().map(|(n, v, _)| (python_name(n), *v)).collect();
        let src =
            std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("python/nvfp4_moe/layer.py")).unwrap();
        let body = src.split("class Tile(enum.IntEnum):").nth(1).expect("class Tile in layer.py");
        let mut got: Vec<(String, i64)> = body
            .lines()
            .skip(1)
            .take_while(|l| l.is_empty() || l.starts_with("    "))
            .filter_map(|l| {
                let (name, value) = l.trim().split_once(" = ")?;
                Some((name.to_string(), value.parse().ok()?))
            })
            .collect();
        want.sort();
        got.sort();
        assert!(want.len() >= 8, "{want:?}");
        assert_eq!(got, want, "python/nvfp4_moe/layer.py's Tile against types.h's GemmTile");
    }
}
