//! `nvfp4-moe`: quantize safetensors weights to NVFP4 (ModelOpt's checkpoint layout) on the CPU or
//! a CUDA GPU, decode them back, run, check and benchmark the NVFP4 MoE layer on a GPU, and report
//! how the crate was built.
//!
//! One module per subcommand (its flags as a clap `Args` struct beside the code that runs it),
//! plus `common` (output, diagnostics, progress, formatting), `gpu` (backend and GPU checks) and
//! `usage` (usage errors).
//!
//! Contract: results alone on stdout (text, or one JSON document with `--json`); notes, warnings,
//! timings and progress bars on stderr; exit status 0 success, 1 error (one `error: ...` line on
//! stderr), 2 usage error (`error: ...` naming the flag, then a `Usage:` line).

// Without the `cuda` feature the GPU paths are stubs, and the helpers only they use are unused.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod bench;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod check;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod common;
mod convert;
mod dequantize;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod gpu;
mod info;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod quantize;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod run;
mod usage;

use std::ffi::OsString;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::error::ErrorKind;
use clap::{ArgAction, Parser, Subcommand};

use crate::common::{eprint_line, init_diagnostics, CliResult, Fail, Global};

const ABOUT: &str =
    "NVFP4 quantization of safetensors weights and the NVFP4 Mixture-of-Experts layer (CUDA, Hopper sm_90a)";

const AFTER_HELP: &str = "\
NVFP4: value = e2m1 (4-bit code) x e4m3 (scale of each block of 16 along K) x g, where g is
the FP32 per-tensor decode scale (ModelOpt's weight_scale_2; other libraries' \"global
scale\" is 1/g).

Examples:
  nvfp4-moe quantize --input w.safetensors --tensor gate --output q.safetensors [--backend cpu|cuda]
  nvfp4-moe dequantize --input q.safetensors --output w2.safetensors [--backend cpu|cuda]
  nvfp4-moe convert --input MODEL_DIR --output NVFP4_DIR [--device cpu|cuda] [--format modelopt]
  nvfp4-moe check --preset deepseek-v3 --tokens 32
  nvfp4-moe --json info
  nvfp4-moe help quantize

Presets of check and bench: deepseek-v3, kimi-k2, qwen3-235b-a22b, qwen3-30b-a3b,
mixtral-8x7b, gpt-oss-120b (`nvfp4-moe check --help` lists their shapes).

Output: the result on stdout (one JSON document with --json, schema in the README); notes,
warnings, timings and progress on stderr.
Exit status: 0 success, 1 error, 2 usage error.";

/// The command line.
#[derive(Debug, Parser)]
#[command(name = "nvfp4-moe", version, about = ABOUT, after_help = AFTER_HELP, max_term_width = 100)]
pub struct Cli {
    /// Print the result as one JSON document on stdout instead of text
    #[arg(long, global = true, display_order = 100)]
    json: bool,
    /// Print only warnings and errors on stderr (no notes, timings or progress bars)
    #[arg(short, long, global = true, display_order = 101)]
    quiet: bool,
    /// More diagnostics on stderr (-v debug, -vv trace)
    #[arg(short = 'v', action = ArgAction::Count, global = true, display_order = 102)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
enum Command {
    #[command(about = quantize::ABOUT, after_help = quantize::AFTER_HELP)]
    Quantize(quantize::QuantizeArgs),
    #[command(about = dequantize::ABOUT, after_help = dequantize::AFTER_HELP)]
    Dequantize(dequantize::DequantizeArgs),
    #[command(about = convert::ABOUT, after_help = convert::AFTER_HELP)]
    Convert(convert::ConvertArgs),
    #[command(about = check::ABOUT, after_help = check::after_help())]
    Check(check::CheckArgs),
    #[command(about = run::ABOUT, after_help = run::AFTER_HELP)]
    Run(run::RunArgs),
    #[command(about = bench::ABOUT, after_help = bench::AFTER_HELP)]
    Bench(bench::BenchArgs),
    #[command(about = info::ABOUT, after_help = info::AFTER_HELP)]
    Info(info::InfoArgs),
}

impl Command {
    fn name(&self) -> &'static str {
        match self {
            Command::Quantize(_) => "quantize",
            Command::Dequantize(_) => "dequantize",
            Command::Convert(_) => "convert",
            Command::Check(_) => "check",
            Command::Run(_) => "run",
            Command::Bench(_) => "bench",
            Command::Info(_) => "info",
        }
    }
}

fn dispatch(cli: &Cli) -> CliResult {
    let global = Global { json: cli.json };
    match &cli.command {
        Command::Quantize(a) => quantize::run(a, global),
        Command::Dequantize(a) => dequantize::run(a, global),
        Command::Convert(a) => convert::run(a, global),
        Command::Check(a) => check::run(a, global),
        Command::Run(a) => run::run(a, global),
        Command::Bench(a) => bench::run(a, global),
        Command::Info(a) => info::run(a, global),
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

fn main() -> ExitCode {
    // Last resort: a panic prints one line (the first one only), never a trace.
    static PANICKED: AtomicBool = AtomicBool::new(false);
    std::panic::set_hook(Box::new(|p| {
        if !PANICKED.swap(true, Ordering::SeqCst) {
            let at = p.location().map(|l| format!(" (at {}:{})", l.file(), l.line())).unwrap_or_default();
            eprint_line(&format!("error: internal error: {}{at}", panic_message(p.payload()).replace('\n', " ")));
        }
    }));

    let args: Vec<OsString> = std::env::args_os().collect();
    let cli = match Cli::try_parse_from(&args) {
        Ok(cli) => cli,
        Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => {
            // Help and version go to stdout; a closed pipe is not an error.
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("{}", usage::render_clap(&e, &args));
            return ExitCode::from(2);
        }
    };
    init_diagnostics(cli.quiet, cli.verbose);
    let name = cli.command.name();
    match std::panic::catch_unwind(|| dispatch(&cli)) {
        Ok(Ok(())) => ExitCode::SUCCESS,
        Ok(Err(Fail::Run(msg))) => {
            eprint_line(&format!("error: {}", msg.replace('\n', " ")));
            ExitCode::from(1)
        }
        Ok(Err(Fail::Usage { msg, command })) => {
            debug_assert_eq!(command, name);
            eprint_line(&usage::render(&msg, Some(command)));
            ExitCode::from(2)
        }
        Err(_) => ExitCode::from(1),
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("nvfp4-moe").chain(args.iter().copied()))
    }

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn moe_command_flags() {
        let Command::Check(c) = parse(&["check"]).unwrap().command else { panic!() };
        assert_eq!((c.preset.name, c.tokens, c.intermediate), ("qwen3-30b-a3b", 4, check::IntermediateArg::Bf16));
        let Command::Check(c) = parse(&["check", "--preset", "kimi-k2", "--tokens=7"]).unwrap().command else {
            panic!()
        };
        assert_eq!((c.preset.name, c.tokens), ("kimi-k2", 7));
        assert_eq!(parse(&["check", "--help"]).unwrap_err().kind(), ErrorKind::DisplayHelp);
        assert_eq!(parse(&["check", "--tile", "n16"]).unwrap_err().kind(), ErrorKind::UnknownArgument);

        let e = parse(&["run", "--weights", "w"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::MissingRequiredArgument);
        let cli = parse(&["run", "--weights", "w", "--prefix", "", "--input", "x", "--output", "y"]).unwrap();
        let Command::Run(r) = cli.command else { panic!() };
        assert_eq!((r.weights.as_str(), r.prefix.as_str(), r.tile), ("w", "", run::TileArg::Auto));

        let cli =
            parse(&["bench", "--preset", "deepseek-v3,mixtral-8x7b", "--tokens", "1,8", "--json-file", "o"]).unwrap();
        let Command::Bench(b) = cli.command else { panic!() };
        let names: Vec<&str> = b.preset.0.iter().map(|p| p.name).collect();
        assert_eq!(
            (names, b.tokens.0, b.json_file.as_deref()),
            (vec!["deepseek-v3", "mixtral-8x7b"], vec![1, 8], Some("o"))
        );
        let Command::Bench(b) = parse(&["bench"]).unwrap().command else { panic!() };
        assert_eq!((b.preset.0[0].name, b.tokens.0), ("qwen3-30b-a3b", vec![1, 16, 128, 1024, 8192]));
        assert_eq!((b.tile, b.batch_invariant), (run::TileArg::Auto, false));
        let Command::Bench(b) = parse(&["bench", "--tile", "n64", "--batch-invariant"]).unwrap().command else {
            panic!()
        };
        assert_eq!((b.tile, b.batch_invariant), (run::TileArg::N64, true));
        // --ep N (1..=64) and --transport, which needs --ep.
        let Command::Bench(b) = parse(&["bench", "--ep", "8", "--transport", "nccl"]).unwrap().command else {
            panic!()
        };
        assert_eq!((b.ep, b.transport), (Some(8), bench::TransportArg::Nccl));
        let Command::Bench(b) = parse(&["bench", "--ep", "2"]).unwrap().command else { panic!() };
        assert_eq!((b.ep, b.transport), (Some(2), bench::TransportArg::Loopback));
        assert_eq!(parse(&["bench", "--ep", "0"]).unwrap_err().kind(), ErrorKind::ValueValidation);
        assert_eq!(parse(&["bench", "--ep", "65"]).unwrap_err().kind(), ErrorKind::ValueValidation);
        assert_eq!(parse(&["bench", "--transport", "nccl"]).unwrap_err().kind(), ErrorKind::MissingRequiredArgument);
        let Command::Bench(b) = parse(&["bench", "--ep", "4", "--payload", "nvfp4"]).unwrap().command else { panic!() };
        assert_eq!(b.payload, bench::PayloadArg::Nvfp4);
        assert_eq!(parse(&["bench", "--payload", "nvfp4"]).unwrap_err().kind(), ErrorKind::MissingRequiredArgument);
        let Command::Bench(b) = parse(&["bench", "--dispatched"]).unwrap().command else { panic!() };
        assert!(b.dispatched);
        assert_eq!(parse(&["bench", "--dispatched", "--ep", "2"]).unwrap_err().kind(), ErrorKind::ArgumentConflict);

        // --json anywhere, for every command.
        for cmd in ["quantize", "dequantize", "convert", "check", "run", "bench", "info"] {
            let mut cli = Cli::command();
            cli.build();
            let sub = cli.find_subcommand(cmd).unwrap();
            assert!(sub.get_arguments().any(|a| a.get_long() == Some("json")), "{cmd}");
            assert!(sub.get_after_help().is_some_and(|h| h.to_string().contains("Example")), "{cmd}");
        }
        assert!(parse(&["--json", "info"]).unwrap().json);
        assert!(parse(&["info", "--json"]).unwrap().json);
        assert!(!parse(&["info"]).unwrap().json);
    }

    #[test]
    fn quantize_flags() {
        let cli = parse(&["quantize", "--input=a", "--tensor", "t", "--output", "b", "--prefix", "", "--backend=cpu"]);
        let Command::Quantize(q) = cli.unwrap().command else { panic!() };
        assert_eq!((q.input.as_str(), q.tensor.as_str(), q.output.as_str()), ("a", "t", "b"));
        assert_eq!((q.prefix.as_deref(), q.backend), (Some(""), Some(gpu::Backend::Cpu)));
        let cli = parse(&["dequantize", "--input", "a", "--output", "b"]).unwrap();
        let Command::Dequantize(d) = cli.command else { panic!() };
        assert_eq!((d.name.as_str(), d.prefix, d.backend), ("weight", None, None));
    }

    #[test]
    fn convert_flags() {
        let cli = parse(&["convert", "--input", "m", "--output", "o"]).unwrap();
        let Command::Convert(c) = cli.command else { panic!() };
        assert_eq!(
            (c.input.as_str(), c.output.as_str(), c.format, c.device, c.force),
            ("m", "o", convert::FormatArg::CompressedTensors, None, false)
        );
        let cli = parse(&[
            "convert",
            "--input=m",
            "--output=o",
            "--format",
            "modelopt",
            "--device",
            "cpu",
            "--include",
            "*.q_proj.weight",
            "--include",
            "*.k_proj.weight",
            "--exclude",
            "*.experts.0.*",
            "--force",
        ])
        .unwrap();
        let Command::Convert(c) = cli.command else { panic!() };
        assert_eq!((c.format, c.device, c.force), (convert::FormatArg::Modelopt, Some(gpu::Backend::Cpu), true));
        assert_eq!((c.include.len(), c.exclude.len()), (2, 1));
        assert_eq!(parse(&["convert", "--input", "m"]).unwrap_err().kind(), ErrorKind::MissingRequiredArgument);
        assert_eq!(
            parse(&["convert", "--input", "m", "--output", "o", "--format", "nvfp4"]).unwrap_err().kind(),
            ErrorKind::InvalidValue
        );
    }
}
