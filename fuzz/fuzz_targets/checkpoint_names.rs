#![no_main]
//! `nvfp4_moe::fuzzing::checkpoint_names`: see its docs for the input format and the invariants checked.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    nvfp4_moe::fuzzing::checkpoint_names(data);
});
