//! The C ABI (`cpp/include/nvfp4moe/nvfp4moe_c.h`, issue 19) on the GPU: the same layer through
//! the C handles gives the Rust `MoeLayer`'s bytes (both run the core's one layer), at deepseek-v3,
//! qwen3-30b-a3b and mixtral-8x7b (every expert: the tiles and splits are those of the real layers)
//! and T = 1, 16 and 1024, and its
//! output is within the f64 reference's tolerance; a bad expert id comes back through
//! `nvfp4moe_layer_check`; a forward captured into a CUDA graph replays the eager bytes. The C
//! functions are in the static core the test links.

use super::*;
use crate::layer::moe_layer::random_checkpoint;
use cudarc::driver::DevicePtr;
use nvfp4_moe::abi::{MoeForwardArgs, MoeLayerDesc};
use nvfp4_moe::moe::MoeInput;
use nvfp4_moe::{MoeLayer, MoeOptions, MoeWeights};
use std::ffi::{c_void, CStr};

#[repr(C)]
struct WeightsCreateArgs {
    struct_size: i64,
    codes: u64,
    scales: u64,
    experts: i64,
    n: i64,
    k: i64,
    decode_scales: *const f32,
    up_decode_scales: *const f32,
}

#[repr(C)]
struct LayerCreateArgs {
    struct_size: i64,
    w13: *const c_void,
    w2: *const c_void,
    options: MoeLayerDesc,
}

#[repr(C)]
struct ForwardArgs {
    struct_size: i64,
    args: MoeForwardArgs,
}

extern "C" {
    fn nvfp4moe_last_error() -> *const std::ffi::c_char;
    fn nvfp4moe_weights_create(args: *const WeightsCreateArgs, stream: *mut c_void, out: *mut *mut c_void) -> i32;
    fn nvfp4moe_weights_destroy(w: *mut c_void) -> i32;
    fn nvfp4moe_layer_create(args: *const LayerCreateArgs, out: *mut *mut c_void) -> i32;
    fn nvfp4moe_layer_destroy(l: *mut c_void) -> i32;
    fn nvfp4moe_layer_workspace_size(l: *const c_void, bytes: *mut usize) -> i32;
    fn nvfp4moe_layer_workspace_init(l: *const c_void, ws: u64, bytes: usize, stream: *mut c_void) -> i32;
    fn nvfp4moe_layer_forward(l: *const c_void, args: *const ForwardArgs, stream: *mut c_void) -> i32;
    #[allow(clippy::too_many_arguments)]
    fn nvfp4moe_layer_check(
        l: *const c_void,
        ws: u64,
        bytes: usize,
        top_k: i64,
        stream: *mut c_void,
        found: *mut i32,
        token: *mut i64,
        slot: *mut i64,
        id: *mut i32,
    ) -> i32;
}

/// Panics with the core's message unless `status` is success.
fn ok(status: i32, what: &str) {
    if status != 0 {
        // SAFETY: the core's thread-local message, a NUL-terminated string.
        let msg = unsafe { CStr::from_ptr(nvfp4moe_last_error()) }.to_string_lossy().into_owned();
        panic!("{what}: status {status}: {msg}");
    }
}

fn addr<T, B: DevicePtr<T>>(s: &CudaStream, b: &B) -> u64 {
    b.device_ptr(s).0
}

/// A forward of `t` tokens over device buffers (addresses) with the caller's top-k.
fn forward_args(hidden: u64, t: usize, k: usize, ids: u64, weights: u64, out: u64, ws: (u64, usize)) -> ForwardArgs {
    ForwardArgs {
        struct_size: std::mem::size_of::<ForwardArgs>() as i64,
        args: MoeForwardArgs {
            hidden,
            tokens: t as i64,
            top_k: k as i64,
            topk_ids: ids,
            topk_weights: weights,
            out,
            workspace: ws.0,
            workspace_bytes: ws.1 as i64,
            ..Default::default()
        },
    }
}

/// A C ABI layer over a checkpoint's tensors (uploaded, then prepared by the core), with its
/// workspace set up on `s`; the handles are destroyed on drop (the layer first).
struct CLayer {
    w13: *mut c_void,
    w2: *mut c_void,
    layer: *mut c_void,
    ws: CudaSlice<u8>,
    ws_bytes: usize,
}

impl CLayer {
    fn new(s: &Arc<CudaStream>, ck: &nvfp4_moe::host::MoeCheckpoint, max_tokens: usize, k: usize) -> Self {
        let cs = s.cu_stream() as *mut c_void;
        let prepare = |w: &nvfp4_moe::host::ExpertWeightsHost, up: Option<&[f32]>| {
            let (codes, scales) = (s.clone_htod(&w.codes).unwrap(), s.clone_htod(&w.scales).unwrap());
            let args = WeightsCreateArgs {
                struct_size: std::mem::size_of::<WeightsCreateArgs>() as i64,
                codes: addr(s, &codes),
                scales: addr(s, &scales),
                experts: w.experts as i64,
                n: w.n as i64,
                k: w.k as i64,
                decode_scales: w.decode_scales.as_ptr(),
                up_decode_scales: up.map_or(std::ptr::null(), <[f32]>::as_ptr),
            };
            let mut handle = std::ptr::null_mut();
            // SAFETY: the buffers hold [E, n, k/2] codes and [E, n, k/16] scales on the stream's
            // device, E decode scales each; the call synchronizes the stream before returning.
            ok(unsafe { nvfp4moe_weights_create(&args, cs, &mut handle) }, "nvfp4moe_weights_create");
            handle
        };
        let (w13, w2) = (prepare(&ck.w13, Some(&ck.up_decode_scales)), prepare(&ck.w2, None));
        let la = LayerCreateArgs {
            struct_size: std::mem::size_of::<LayerCreateArgs>() as i64,
            w13,
            w2,
            options: MoeLayerDesc { max_tokens: max_tokens as i64, max_top_k: k as i64, ..Default::default() },
        };
        let mut layer = std::ptr::null_mut();
        // SAFETY: two handles made above.
        ok(unsafe { nvfp4moe_layer_create(&la, &mut layer) }, "nvfp4moe_layer_create");
        let mut ws_bytes = 0usize;
        // SAFETY: a layer handle.
        ok(unsafe { nvfp4moe_layer_workspace_size(layer, &mut ws_bytes) }, "nvfp4moe_layer_workspace_size");
        let ws = s.alloc_zeros::<u8>(ws_bytes).unwrap();
        // SAFETY: ws holds ws_bytes on the stream's device.
        ok(unsafe { nvfp4moe_layer_workspace_init(layer, addr(s, &ws), ws_bytes, cs) }, "workspace_init");
        CLayer { w13, w2, layer, ws, ws_bytes }
    }

    /// The workspace as a forward takes it: (address, bytes).
    fn workspace(&self, s: &CudaStream) -> (u64, usize) {
        (addr(s, &self.ws), self.ws_bytes)
    }
}

impl Drop for CLayer {
    fn drop(&mut self) {
        // SAFETY: handles made by new(); the caller synchronized the work that uses them (every
        // test reads its outputs back first).
        unsafe {
            ok(nvfp4moe_layer_destroy(self.layer), "nvfp4moe_layer_destroy");
            ok(nvfp4moe_weights_destroy(self.w13), "nvfp4moe_weights_destroy");
            ok(nvfp4moe_weights_destroy(self.w2), "nvfp4moe_weights_destroy");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn c_abi_layer_gives_the_rust_layers_bytes() {
    let ctx = stream().context().clone();
    // A stream of its own: the C ABI takes the device from it.
    let s = ctx.new_stream().unwrap();
    let cs = s.cu_stream() as *mut c_void;
    let mut rng = test_rng();
    let rp = replay();
    // (name, E, H, I, k): the presets' shapes. deepseek-v3's 256 experts are 6.3 GB of prepared
    // weights per layer (two layers here: the Rust one and the C one).
    for &(name, e, h, i, k) in &[
        ("deepseek-v3", 256usize, 7168usize, 2048usize, 8usize),
        ("qwen3-30b-a3b", 128, 2048, 768, 8),
        ("mixtral-8x7b", 8, 4096, 14336, 2),
    ] {
        let ck = random_checkpoint(&mut rng, e, h, i);
        let rust = MoeLayer::new(MoeWeights::from_checkpoint(&s, &ck).unwrap(), MoeOptions::new(1024, k)).unwrap();
        let mut rust_ws = rust.workspace(&s).unwrap();

        // The C handles, from the same checkpoint tensors on the device.
        let c = CLayer::new(&s, &ck, 1024, k);
        let layer = c.layer;

        for t in [1usize, 16, 1024] {
            let ids: Vec<i32> = (0..t * k).map(|_| rng.below(e as u64) as i32).collect();
            let w: Vec<f32> = (0..t * k).map(|_| rng.uniform(0.1, 1.0)).collect();
            let hidden = rng.normal_bf16(t * h, 1.0);
            let (hd, idd, wd) =
                (s.clone_htod(&hidden).unwrap(), s.clone_htod(&ids).unwrap(), s.clone_htod(&w).unwrap());
            let poison = vec![bf16::from_bits(POISON_BF16); t * h];
            let mut rust_out = s.clone_htod(&poison).unwrap();
            let input = MoeInput { hidden: &hd, tokens: t, topk_ids: &idd, topk_weights: &wd, top_k: k };
            rust.forward(&s, &input, &mut rust_out, &mut rust_ws).unwrap();
            let c_out = s.clone_htod(&poison).unwrap();
            let f = forward_args(addr(&s, &hd), t, k, addr(&s, &idd), addr(&s, &wd), addr(&s, &c_out), c.workspace(&s));
            // SAFETY: every buffer holds what t, k, H and the layer imply, on the stream's device.
            ok(unsafe { nvfp4moe_layer_forward(layer, &f, cs) }, "nvfp4moe_layer_forward");
            let (a, b) = (s.clone_dtoh(&rust_out).unwrap(), s.clone_dtoh(&c_out).unwrap());
            let ctx = format!("{name} T={t}: {rp}");
            assert!(b.iter().all(|v| v.to_bits() != POISON_BF16), "C ABI output not all written: {ctx}");
            let same = a.iter().zip(&b).filter(|(x, y)| x.to_bits() == y.to_bits()).count();
            assert_eq!(same, t * h, "C ABI and Rust layer bytes differ: {ctx}");
            if t == 16 {
                // And within the f64 reference's tolerance (the Rust layer's own test bound).
                let want = reference::routing::moe_layer(&hidden, t, &ids, &w, k, &ck).unwrap();
                let mut err = RelErr::default();
                for (g, x) in b.iter().zip(&want) {
                    err.add(f64::from(g.to_f32()), *x);
                }
                assert!(err.rel() <= 1e-2, "relative error {:.3e}: {ctx}", err.rel());
                err.report(&format!("C ABI layer {name} T={t}"));
            }
        }

        // A bad expert id: reported by the check (token, slot, id), then cleared.
        let t = 3usize;
        let mut ids: Vec<i32> = (0..t * k).map(|_| rng.below(e as u64) as i32).collect();
        ids[k + k - 1] = e as i32 + 5;
        let (hd, idd, wd) = (
            s.clone_htod(&rng.normal_bf16(t * h, 1.0)).unwrap(),
            s.clone_htod(&ids).unwrap(),
            s.clone_htod(&vec![0.5f32; t * k]).unwrap(),
        );
        let out = s.alloc_zeros::<bf16>(t * h).unwrap();
        let f = forward_args(addr(&s, &hd), t, k, addr(&s, &idd), addr(&s, &wd), addr(&s, &out), c.workspace(&s));
        let (mut found, mut token, mut slot, mut id) = (0i32, 0i64, 0i64, 0i32);
        // SAFETY: as above; the check's outputs are host variables.
        unsafe {
            ok(nvfp4moe_layer_forward(layer, &f, cs), "forward with a bad id");
            let (ws, ws_bytes) = c.workspace(&s);
            ok(
                nvfp4moe_layer_check(layer, ws, ws_bytes, k as i64, cs, &mut found, &mut token, &mut slot, &mut id),
                "check",
            );
            assert_eq!((found, token, slot, id), (1, 1, k as i64 - 1, e as i32 + 5), "{name}: {rp}");
            ok(
                nvfp4moe_layer_check(layer, ws, ws_bytes, k as i64, cs, &mut found, &mut token, &mut slot, &mut id),
                "check",
            );
            assert_eq!(found, 0, "{name}: the check clears the word: {rp}");
        }
    }
}

/// `nvfp4moe_layer_forward` captured into a CUDA graph (thread-local mode: this thread may make no
/// capture-unsafe call, such as cudaStreamGetDevice, which session 17 found the ABI making) and
/// replayed: the eager bytes; before the replay the output is untouched. PyTorch's global mode is
/// python/tests/test_layer.py's `test_c_abi_forward_captures_in_a_graph`.
#[test]
#[ignore = "needs a CUDA GPU"]
fn c_abi_forward_is_graph_capturable() {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let ctx = stream().context().clone();
    let s = ctx.new_stream().unwrap();
    let cs = s.cu_stream() as *mut c_void;
    let mut rng = test_rng();
    let rp = replay();
    let (e, h, i, t, k) = (16usize, 512usize, 256usize, 24usize, 4usize);
    let ck = random_checkpoint(&mut rng, e, h, i);
    let c = CLayer::new(&s, &ck, 64, k);
    let layer = c.layer;

    let ids: Vec<i32> = (0..t * k).map(|_| rng.below(e as u64) as i32).collect();
    let w: Vec<f32> = (0..t * k).map(|_| rng.uniform(0.1, 1.0)).collect();
    let (hd, idd, wd) =
        (s.clone_htod(&rng.normal_bf16(t * h, 1.0)).unwrap(), s.clone_htod(&ids).unwrap(), s.clone_htod(&w).unwrap());
    let poison = vec![bf16::from_bits(POISON_BF16); t * h];
    let mut out = s.clone_htod(&poison).unwrap();
    let f = forward_args(addr(&s, &hd), t, k, addr(&s, &idd), addr(&s, &wd), addr(&s, &out), c.workspace(&s));
    // SAFETY: every buffer holds what t, k, H and the layer imply, on the stream's device.
    ok(unsafe { nvfp4moe_layer_forward(layer, &f, cs) }, "eager nvfp4moe_layer_forward");
    let eager = s.clone_dtoh(&out).unwrap();
    assert!(eager.iter().all(|v| v.to_bits() != POISON_BF16), "eager output not all written: {rp}");
    s.memcpy_htod(&poison, &mut out).unwrap();
    s.synchronize().unwrap();
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    // SAFETY: as above.
    let status = unsafe { nvfp4moe_layer_forward(layer, &f, cs) };
    let graph = s.end_capture(CUgraphInstantiate_flags(0));
    ok(status, "captured nvfp4moe_layer_forward");
    let graph = graph.unwrap().expect("a captured graph");
    assert!(s.clone_dtoh(&out).unwrap().iter().all(|v| v.to_bits() == POISON_BF16), "capture ran the forward: {rp}");
    for _ in 0..2 {
        graph.launch().unwrap();
    }
    let replayed = s.clone_dtoh(&out).unwrap();
    assert!(eager.iter().zip(&replayed).all(|(a, b)| a.to_bits() == b.to_bits()), "graph replay: {rp}");
}
