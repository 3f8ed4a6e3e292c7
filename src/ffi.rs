//! The raw cxx bridge to the C++ core. Nothing here validates: the safe layer
//! (`quantize.rs` and friends) checks every argument before it calls in.
//!
//! Device pointers and streams cross as `u64` (a `CUdeviceptr` / `CUstream`).

#[cxx::bridge(namespace = "nvfp4moe::bridge")]
pub(crate) mod raw {
    /// Arguments of `quantize_nvfp4` (see `cpp/include/nvfp4moe/nvfp4moe.h`).
    struct QuantizeParams {
        x: u64,
        rows: i64,
        cols: i64,
        decode_scale: f32,
        layout: u32,
        codes: u64,
        scales: u64,
        stream: u64,
    }

    /// Arguments of `dequantize_nvfp4`.
    struct DequantizeParams {
        codes: u64,
        scales: u64,
        rows: i64,
        cols: i64,
        decode_scale: f32,
        layout: u32,
        out: u64,
        stream: u64,
    }

    /// Arguments of `quantize_nvfp4_grouped`.
    struct QuantizeGroupedParams {
        x: u64,
        source: i32,
        rows: i64,
        cols: i64,
        expert_offsets: u64,
        experts: i64,
        decode_scales: u64,
        num_decode_scales: i64,
        codes: u64,
        scales: u64,
        stream: u64,
    }

    /// Arguments of `permute_and_gather`.
    struct PermuteParams {
        topk_ids: u64,
        tokens: i64,
        top_k: i64,
        experts: i64,
        hidden: u64,
        hidden_size: i64,
        expert_offsets: u64,
        row_of_pair: u64,
        pair_of_row: u64,
        x_perm: u64,
        error: u64,
        workspace: u64,
        stream: u64,
    }

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

    /// Arguments of `prepare_nvfp4_weights`.
    struct PrepareWeightsParams {
        codes: u64,
        scales: u64,
        experts: i64,
        n: i64,
        k: i64,
        row_order: i32,
        prepared: u64,
        error: u64,
        stream: u64,
    }

    /// Arguments of `grouped_gemm_nvfp4`.
    struct GroupedGemmParams {
        prepared: u64,
        decode_scale: u64,
        experts: i64,
        n: i64,
        k: i64,
        x: u64,
        total_rows: i64,
        expert_offsets: u64,
        out: u64,
        out_scales: u64,
        act_decode_scales: u64,
        num_act_decode_scales: i64,
        tile: i32,
        epilogue: i32,
        stream: u64,
    }

    unsafe extern "C++" {
        include!("nvfp4-moe/cpp/bridge/shim.h");

        /// # Safety
        /// Every pointer must be a live device allocation of the size the arguments imply, on the
        /// context of `stream`, and must stay alive until the enqueued work has finished.
        unsafe fn quantize_nvfp4(p: &QuantizeParams) -> Result<()>;

        /// # Safety
        /// As for `quantize_nvfp4`.
        unsafe fn dequantize_nvfp4(p: &DequantizeParams) -> Result<()>;

        /// # Safety
        /// Every pointer must be a live device allocation of the size the arguments imply.
        unsafe fn prepare_nvfp4_weights(p: &PrepareWeightsParams) -> Result<()>;

        /// # Safety
        /// Every pointer must be a live device allocation of the size the arguments imply, and
        /// `prepared` must hold weights prepared for the same experts, n and k.
        unsafe fn grouped_gemm_nvfp4(p: &GroupedGemmParams) -> Result<()>;

        /// # Safety
        /// Every pointer must be a live device allocation of the size the arguments imply.
        unsafe fn quantize_nvfp4_grouped(p: &QuantizeGroupedParams) -> Result<()>;
        /// # Safety
        /// As `quantize_nvfp4_grouped`; `x` is the bf16 output here.
        unsafe fn dequantize_nvfp4_grouped(p: &QuantizeGroupedParams) -> Result<()>;

        /// # Safety
        /// `gate_up` holds rows x 2 inter bf16 and `out` rows x inter bf16, on the stream's device.
        unsafe fn swiglu_bf16(gate_up: u64, rows: i64, inter: i64, out: u64, stream: u64) -> Result<()>;

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
        ) -> Result<()>;

        /// # Safety
        /// Every pointer must be a live device allocation of the size the arguments imply.
        unsafe fn permute_and_gather(p: &PermuteParams) -> Result<()>;

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
        ) -> Result<()>;

        fn core_permute_workspace_bytes(pairs: i64, experts: i64) -> u64;
        fn core_grouped_scale_bytes(rows: i64, experts: i64, cols: i64) -> u64;
        fn core_prepared_weight_bytes(experts: i64, n: i64, k: i64) -> u64;
        fn core_choose_gemm_tile(total_rows: i64, experts: i64) -> i32;

        fn core_build_info() -> CoreBuildInfo;
        fn core_scale_bytes(layout: u32, rows: i64, cols: i64) -> u64;
    }
}
