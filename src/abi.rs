//! The types shared with the C++ core: generated at build time from
//! `cpp/include/nvfp4moe/types.h`, their one declaration (see `codegen/abi.rs`).
//!
//! The constants, the status codes and the enums ([`ScaleLayout`], [`RowOrder`], [`GemmTile`],
//! [`GemmEpilogue`], [`GroupedSource`]) are here with or without the `cuda` feature; with it, also
//! the `#[repr(C)]` launch argument structs (`*Args`) that the bridge hands to the core as they are.
//! A change to a value or a field in the header changes this module in the same build, and the
//! generated layout is asserted by rustc and, in `abi_check.cc`, by the C++ compiler.

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
        assert_eq!(GemmEpilogue::SwigluNvfp4 as i32, 3);
        assert_eq!(Status::from_raw(6), Some(Status::CudaError));
        assert_eq!(Status::from_raw(7), None);
        assert_eq!(RowOrder::GateUpBands8.cxx_name(), "kGateUpBands8");
        assert_eq!(EXPERT_LIMIT, 1024);
        assert_eq!(TOP_K_LIMIT, 32);
    }
}
