//! Builds the C++/CUDA core with CMake (through the `cmake` crate, always Release) and the cxx
//! bridge (through `cxx-build`), and links both with the static CUDA runtime.
//!
//! Toolchain lookup: `NVCC` (path to nvcc) or `CUDA_HOME`, else `third_party/cuda`; `CUTLASS_DIR`,
//! else `third_party/cutlass`; `CMAKE` or `cmake` on PATH, else `third_party/cmake/bin/cmake`.
//! `third_party/fetch.sh` installs the pinned ones. `NVFP4MOE_CUDA_ARCHS` overrides the target list
//! (CMake syntax, default `90a-real` = `-gencode=arch=compute_90a,code=sm_90a`).
//!
//! The CMake build directory is shared by every cargo profile (`<target>/nvfp4moe-core`, or
//! `NVFP4MOE_CORE_BUILD_DIR`), so the heavy CUDA files compile once, not once per profile.
//! `CMAKE_BUILD_PARALLEL_LEVEL=N` caps the CUDA compile at N jobs (each heavy file takes ~4.6 GB);
//! otherwise it takes cargo's job slots.
//!
//! Nothing is built, and no toolchain is looked for, without the `cuda` feature or under `DOCS_RS`
//! (docs.rs has no CUDA toolkit; rustdoc needs neither the core nor the bridge).

#[path = "codegen/abi.rs"]
#[allow(dead_code)]
mod abi;

/// The one declaration of the FFI types, and where the Rust side generated from it goes.
const ABI_HEADER: &str = "cpp/include/nvfp4moe/types.h";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=codegen/abi.rs");
    println!("cargo:rerun-if-changed={ABI_HEADER}");
    // Always (the format's enums are public without the `cuda` feature too): the Rust side of
    // cpp/include/nvfp4moe/types.h into OUT_DIR (abi_types.rs, abi_structs.rs, abi_check.cc).
    let header = std::fs::read_to_string(ABI_HEADER).unwrap_or_else(|e| panic!("{ABI_HEADER}: {e}"));
    let parsed = abi::parse(&header).unwrap_or_else(|e| {
        println!("cargo::error={e}");
        std::process::exit(1);
    });
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let write = |name: &str, text: String| std::fs::write(out_dir.join(name), text).unwrap();
    write("abi_types.rs", abi::rust_types(&parsed));
    write("abi_structs.rs", abi::rust_structs(&parsed));
    write("abi_check.cc", abi::cxx_checks(&parsed, "nvfp4moe/types.h"));
    #[cfg(feature = "cuda")]
    {
        println!("cargo:rerun-if-env-changed=DOCS_RS");
        if std::env::var_os("DOCS_RS").is_none() {
            cuda::build();
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::env;
    use std::fs::File;
    use std::path::{Path, PathBuf};
    use std::process::Command;

    fn fail(msg: &str) -> ! {
        println!("cargo::error={msg}");
        eprintln!("error: {msg}");
        std::process::exit(1);
    }

    pub fn build() {
        for var in [
            "CUDA_HOME",
            "NVCC",
            "CUTLASS_DIR",
            "NVFP4MOE_CUDA_ARCHS",
            "CMAKE",
            "NVFP4MOE_CORE_BUILD_DIR",
            "CMAKE_BUILD_PARALLEL_LEVEL",
            "NVFP4MOE_WARP_VARIANTS",
            "NVFP4MOE_GEMM_VARIANTS",
        ] {
            println!("cargo:rerun-if-env-changed={var}");
        }
        for path in ["cpp", "src/ffi.rs", "third_party/requirements.txt"] {
            println!("cargo:rerun-if-changed={path}");
        }

        let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
        let third_party = manifest.join("third_party");
        let fetch_hint =
            "run `third_party/fetch.sh` to install the pinned CUDA 13.0 toolchain, CUTLASS 4.2 and CMake, \
                      or point NVCC/CUDA_HOME, CUTLASS_DIR and CMAKE at your own";

        let nvcc = match (env::var_os("NVCC"), env::var_os("CUDA_HOME")) {
            (Some(n), _) => PathBuf::from(n),
            (None, Some(h)) => PathBuf::from(h).join("bin/nvcc"),
            (None, None) => third_party.join("cuda/bin/nvcc"),
        };
        if !nvcc.is_file() {
            fail(&format!("nvfp4-moe: nvcc not found at {}: {fetch_hint}", nvcc.display()));
        }
        let cuda_root = nvcc.parent().and_then(Path::parent).unwrap().to_path_buf();
        let cutlass = env::var_os("CUTLASS_DIR").map(PathBuf::from).unwrap_or_else(|| third_party.join("cutlass"));
        if !cutlass.join("include/cutlass/cutlass.h").is_file() {
            fail(&format!("nvfp4-moe: CUTLASS headers not found under {}: {fetch_hint}", cutlass.display()));
        }
        let cmake_bin = env::var_os("CMAKE").map(PathBuf::from).or_else(|| {
            let ok = Command::new("cmake").arg("--version").output().map(|o| o.status.success()).unwrap_or(false);
            if ok {
                None
            } else {
                Some(third_party.join("cmake/bin/cmake"))
            }
        });
        if let Some(c) = &cmake_bin {
            if !c.is_file() {
                fail(&format!("nvfp4-moe: cmake not found: {fetch_hint}"));
            }
            // The `cmake` crate runs $CMAKE when set.
            env::set_var("CMAKE", c);
        }
        let archs = env::var("NVFP4MOE_CUDA_ARCHS").unwrap_or_else(|_| "90a-real".to_string());

        // One CMake build for all profiles: OUT_DIR is <target>/<profile>/build/<pkg>-<hash>/out.
        let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
        let core_dir = env::var_os("NVFP4MOE_CORE_BUILD_DIR").map(PathBuf::from).unwrap_or_else(|| {
            out_dir.ancestors().nth(4).map(|t| t.join("nvfp4moe-core")).unwrap_or_else(|| out_dir.join("core"))
        });
        std::fs::create_dir_all(&core_dir).unwrap();
        // Two profiles building at once must not run CMake in the same folder together.
        let lock = File::create(core_dir.join(".lock")).unwrap();
        lock.lock().unwrap();

        // An explicit CMAKE_BUILD_PARALLEL_LEVEL wins over cargo's jobserver: the `cmake` crate hands
        // make the jobserver (as many jobs as cargo has) when CARGO_MAKEFLAGS is set, and passes
        // `--parallel NUM_JOBS` otherwise.
        if let Some(level) =
            env::var("CMAKE_BUILD_PARALLEL_LEVEL").ok().filter(|l| l.parse::<u32>().is_ok_and(|n| n > 0))
        {
            env::remove_var("CARGO_MAKEFLAGS");
            env::set_var("NUM_JOBS", level);
        }

        let dst = cmake::Config::new(manifest.join("cpp"))
            .out_dir(&core_dir)
            .profile("Release")
            .no_default_flags(true)
            .define("CMAKE_CUDA_COMPILER", &nvcc)
            .define("CUTLASS_DIR", &cutlass)
            .define("NVFP4MOE_CUDA_ARCHS", &archs)
            // NVFP4MOE_WARP_VARIANTS=1: the warp kernel's A/B variants (PERF_NOTES.md session 11).
            .define(
                "NVFP4MOE_WARP_VARIANTS",
                if env::var("NVFP4MOE_WARP_VARIANTS").is_ok_and(|v| v == "1") { "ON" } else { "OFF" },
            )
            // NVFP4MOE_GEMM_VARIANTS=1: the wgmma tiles' A/B variants (gemm_config.cuh).
            .define(
                "NVFP4MOE_GEMM_VARIANTS",
                if env::var("NVFP4MOE_GEMM_VARIANTS").is_ok_and(|v| v == "1") { "ON" } else { "OFF" },
            )
            .define("CMAKE_INSTALL_LIBDIR", "lib")
            .build();
        drop(lock);

        cxx_build::bridge("src/ffi.rs")
            .file("cpp/bridge/shim.cc")
            // The C++ compiler checks the generated Rust layout against the header (codegen/abi.rs).
            .file(out_dir.join("abi_check.cc"))
            .include(manifest.join("cpp/include"))
            .std("c++17")
            .flag_if_supported("-Wno-unused-parameter")
            .compile("nvfp4moe_bridge");

        println!("cargo:rustc-link-search=native={}", dst.join("lib").display());
        println!("cargo:rustc-link-lib=static=nvfp4moe_static");
        for lib in ["lib64", "lib"] {
            let d = cuda_root.join(lib);
            if d.join("libcudart_static.a").is_file() {
                println!("cargo:rustc-link-search=native={}", d.display());
                break;
            }
        }
        // The static CUDA runtime loads the driver (libcuda) with dlopen at run time, like cudarc.
        println!("cargo:rustc-link-lib=static=cudart_static");
        for lib in ["stdc++", "dl", "rt", "pthread"] {
            println!("cargo:rustc-link-lib=dylib={lib}");
        }
        println!("cargo:rustc-env=NVFP4MOE_CUDA_ARCHS={archs}");
    }
}
