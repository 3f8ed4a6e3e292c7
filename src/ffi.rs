//! The raw cxx bridge to the C++ core. Nothing here validates: the safe layer (`launch.rs` and the
//! wrappers in `quantize.rs`, `gemm.rs`, `routing.rs`) checks every argument before it calls in.
//!
//! The argument structs are not declared here: they are the `#[repr(C)]` structs generated from
//! `cpp/include/nvfp4moe/types.h` ([`crate::abi`]), bound as trivial extern types, so the C++ core
//! reads exactly the struct Rust wrote. Entry points return the core's `Status` as `i32`
//! ([`crate::launch::status`] turns it into a typed [`crate::Error`]). Device pointers and streams
//! cross as `u64` (a `CUdeviceptr` / `CUstream`).

#[cxx::bridge(namespace = "nvfp4moe::bridge")]
pub(crate) mod raw {
    /// What the core was built with and what it finds at run time.
    struct CoreBuildInfo {
        cuda_version: i32,
        cuda_archs: String,
        cutlass_major: i32,
        cutlass_minor: i32,
        cutlass_patch: i32,
        runtime_version: i32,
        driver_version: i32,
    }

    #[namespace = "nvfp4moe"]
    unsafe extern "C++" {
        include!("nvfp4-moe/cpp/bridge/shim.h");
        type QuantizeNvfp4Args = crate::abi::QuantizeNvfp4Args;
        type DequantizeNvfp4Args = crate::abi::DequantizeNvfp4Args;
        type QuantizeGroupedArgs = crate::abi::QuantizeGroupedArgs;
        type DequantizeGroupedArgs = crate::abi::DequantizeGroupedArgs;
        type PermuteArgs = crate::abi::PermuteArgs;
        type PrepareWeightsArgs = crate::abi::PrepareWeightsArgs;
        type GroupedGemmArgs = crate::abi::GroupedGemmArgs;
        type MoeLayerDesc = crate::abi::MoeLayerDesc;
        type MoeForwardArgs = crate::abi::MoeForwardArgs;
        type MoeDispatchedArgs = crate::abi::MoeDispatchedArgs;
    }

    unsafe extern "C++" {
        include!("nvfp4-moe/cpp/bridge/shim.h");

        /// # Safety
        /// Every pointer must be a live device allocation of the size the arguments imply, on the
        /// context of `stream`, and must stay alive until the enqueued work has finished.
        unsafe fn quantize_nvfp4(args: &QuantizeNvfp4Args, stream: u64) -> i32;
        /// # Safety
        /// As for `quantize_nvfp4`.
        unsafe fn dequantize_nvfp4(args: &DequantizeNvfp4Args, stream: u64) -> i32;
        /// # Safety
        /// As for `quantize_nvfp4`.
        unsafe fn quantize_nvfp4_grouped(args: &QuantizeGroupedArgs, stream: u64) -> i32;
        /// # Safety
        /// As for `quantize_nvfp4`.
        unsafe fn dequantize_nvfp4_grouped(args: &DequantizeGroupedArgs, stream: u64) -> i32;
        /// # Safety
        /// As for `quantize_nvfp4`; `decode_scales` and (for gate/up weights, else empty)
        /// `up_decode_scales` hold E values, `pairs` 2 E floats. Synchronizes `stream`.
        unsafe fn prepare_moe_weights(
            args: &PrepareWeightsArgs,
            decode_scales: &[f32],
            up_decode_scales: &[f32],
            pairs: u64,
            stream: u64,
        ) -> i32;
        /// # Safety
        /// As for `quantize_nvfp4`, and `prepared` must hold weights prepared for the same experts,
        /// n and k.
        unsafe fn grouped_gemm_nvfp4(args: &GroupedGemmArgs, stream: u64) -> i32;
        /// # Safety
        /// As for `quantize_nvfp4`.
        unsafe fn permute_and_gather(args: &PermuteArgs, stream: u64) -> i32;

        /// # Safety
        /// `gate_up` holds rows x 2 inter bf16 and `out` rows x inter bf16, on the stream's device.
        unsafe fn swiglu_bf16(gate_up: u64, rows: i64, inter: i64, out: u64, stream: u64) -> i32;

        /// # Safety
        /// `logits` holds tokens x experts f32, `ids` and `weights` tokens x top_k, on the device.
        #[allow(clippy::too_many_arguments)]
        unsafe fn softmax_topk(
            logits: u64,
            tokens: i64,
            experts: i64,
            top_k: i64,
            renormalize: bool,
            ids: u64,
            weights: u64,
            stream: u64,
        ) -> i32;

        /// # Safety
        /// `y` holds (tokens x top_k) x hidden bf16, `row_of_pair` and `weights` tokens x top_k,
        /// `out` tokens x hidden bf16, on the device.
        #[allow(clippy::too_many_arguments)]
        unsafe fn combine(
            y: u64,
            row_of_pair: u64,
            weights: u64,
            tokens: i64,
            top_k: i64,
            hidden_size: i64,
            out: u64,
            stream: u64,
        ) -> i32;

        /// # Safety
        /// `src` holds `src_rows` rows of `row_bytes` bytes, `index` `rows` i32 and `dst` `rows`
        /// rows of `row_bytes`, on the device (index values are bounded by the kernel).
        #[allow(clippy::too_many_arguments)]
        unsafe fn gather_rows(
            src: u64,
            src_rows: i64,
            index: u64,
            rows: i64,
            row_bytes: i64,
            dst: u64,
            stream: u64,
        ) -> i32;
        /// # Safety
        /// `src` holds f32 `[src_rows, cols]`, `pos` i32 `[rows, slots]` and `dst` f32
        /// `[rows, cols]`, on the device (positions are bounded by the kernel).
        #[allow(clippy::too_many_arguments)]
        unsafe fn sum_rows_fp32(
            src: u64,
            src_rows: i64,
            pos: u64,
            rows: i64,
            slots: i64,
            cols: i64,
            dst: u64,
            stream: u64,
        ) -> i32;

        /// # Safety
        /// The descriptor's weight pointers name prepared weights of its shape, and `workspace`
        /// holds `workspace_bytes` bytes, on the context of `stream`.
        unsafe fn moe_layer_initialize(d: &MoeLayerDesc, workspace: u64, workspace_bytes: i64, stream: u64) -> i32;
        /// # Safety
        /// As for `moe_layer_initialize`; every buffer of `a` holds what its shape implies and
        /// stays alive until the enqueued work has finished.
        unsafe fn moe_layer_forward(d: &MoeLayerDesc, a: &MoeForwardArgs, stream: u64) -> i32;
        /// # Safety
        /// As for `moe_layer_initialize`; every buffer of `a` holds what its shape implies and
        /// stays alive until the enqueued work has finished.
        unsafe fn moe_layer_forward_dispatched(d: &MoeLayerDesc, a: &MoeDispatchedArgs, stream: u64) -> i32;
        /// # Safety
        /// As for `moe_layer_forward`; `act_out` holds tokens x top_k x intermediate bf16.
        unsafe fn moe_layer_first_gemm(d: &MoeLayerDesc, a: &MoeForwardArgs, act_out: u64, stream: u64) -> i32;
        /// # Safety
        /// As for `moe_layer_initialize`. Synchronizes `stream`.
        unsafe fn moe_layer_read_error(
            d: &MoeLayerDesc,
            workspace: u64,
            workspace_bytes: i64,
            stream: u64,
            word: &mut u64,
        ) -> i32;

        // The core's shape checks (pointers are not read: safe to call with any values).
        fn moe_layer_can_implement(d: &MoeLayerDesc) -> i32;
        fn core_moe_layer_workspace_bytes(d: &MoeLayerDesc) -> u64;
        fn quantize_nvfp4_can_implement(args: &QuantizeNvfp4Args) -> i32;
        fn dequantize_nvfp4_can_implement(args: &DequantizeNvfp4Args) -> i32;
        fn quantize_nvfp4_grouped_can_implement(args: &QuantizeGroupedArgs) -> i32;
        fn dequantize_nvfp4_grouped_can_implement(args: &DequantizeGroupedArgs) -> i32;
        fn permute_and_gather_can_implement(args: &PermuteArgs) -> i32;
        fn prepare_nvfp4_weights_can_implement(args: &PrepareWeightsArgs) -> i32;
        fn grouped_gemm_nvfp4_can_implement(args: &GroupedGemmArgs) -> i32;

        /// The message of the last non-success status on this thread.
        fn last_error_message() -> String;

        fn core_permute_workspace_bytes(pairs: i64, experts: i64) -> u64;
        fn core_grouped_scale_bytes(rows: i64, experts: i64, cols: i64) -> u64;
        fn core_prepared_weight_bytes(experts: i64, n: i64, k: i64) -> u64;
        fn core_choose_gemm_tile(total_rows: i64, experts: i64) -> i32;
        fn core_launch_gemm_tile(args: &GroupedGemmArgs, sms: i32) -> i32;
        fn core_scale_bytes(layout: i32, rows: i64, cols: i64) -> u64;

        fn core_build_info() -> CoreBuildInfo;
    }
}
