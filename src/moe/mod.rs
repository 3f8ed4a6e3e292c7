//! One MoE layer on the GPU, in the order its data flows: [`weights`] (BF16 or a checkpoint ->
//! prepared NVFP4 weights on the device), then [`layer`] (a forward: routing, permutation, the two
//! grouped GEMMs, combine).

pub mod layer;
pub mod weights;

pub use layer::{
    DispatchedInput, Intermediate, MoeInput, MoeLayer, MoeOptions, MoeWorkspace, OutputElement, OutputFormat,
    RouterInput,
};
pub use weights::{quantize_bf16_experts, MoeWeights, MoeWeightsBf16};
