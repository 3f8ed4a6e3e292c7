//! Checkpoints in both NVFP4 dialects against the committed fixtures.

mod checkpoint_fixture;

use checkpoint_fixture::{inputs, root};

/// The committed fixture inputs are what the crate writes today (`NVFP4MOE_WRITE_FIXTURES=1`
/// rewrites them; then rerun scripts/fixtures/compressed_tensors.sh on a GPU machine).
#[test]
fn fixture_inputs_are_current() {
    let write = std::env::var_os("NVFP4MOE_WRITE_FIXTURES").is_some();
    for (rel, bytes) in inputs() {
        let path = root().join(&rel);
        if write {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, &bytes).unwrap();
            continue;
        }
        let committed = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(committed == bytes, "{rel} differs from what the crate writes: rerun with NVFP4MOE_WRITE_FIXTURES=1");
    }
}
