//! Usage errors (exit 2) in one format: a first line `error: ...` that names the offending flag,
//! the command's `Usage:` line, and where to read more. clap's own messages name a missing flag
//! on the next line and word things differently per kind; they are rewritten here.

use std::ffi::OsString;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::CommandFactory;

use crate::Cli;

/// The text of one context value, lists joined with ", ".
fn ctx(err: &clap::Error, kind: ContextKind) -> Option<String> {
    match err.get(kind)? {
        ContextValue::String(s) => Some(s.clone()),
        ContextValue::Strings(v) => Some(v.join(", ")),
        ContextValue::StyledStr(s) => Some(s.to_string()),
        ContextValue::StyledStrs(v) => Some(v.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(", ")),
        ContextValue::Number(n) => Some(n.to_string()),
        ContextValue::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

/// `--tensor` of clap's `--tensor <NAME>`.
fn flag_of(arg: &str) -> &str {
    arg.split([' ', '=']).next().unwrap_or(arg)
}

/// The subcommand the user typed (the first argument naming one), if any.
pub fn typed_command(args: &[OsString]) -> Option<&'static str> {
    let cmd = Cli::command();
    let names: Vec<&'static str> = ["quantize", "dequantize", "info", "run", "check", "bench"]
        .into_iter()
        .filter(|n| cmd.find_subcommand(n).is_some())
        .collect();
    args.iter().skip(1).filter_map(|a| a.to_str()).find_map(|a| names.iter().find(|n| **n == a).copied())
}

/// The flags of subcommand `name` (its own, not the global ones), e.g. `--input, --tensor`.
fn flags_of(name: &str) -> Vec<String> {
    let cmd = Cli::command();
    let Some(sub) = cmd.find_subcommand(name) else { return Vec::new() };
    sub.get_arguments()
        .filter(|a| !a.is_global_set() && a.get_id() != "help")
        .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
        .collect()
}

/// The `Usage:` line of `command` (or of the whole tool for `None`).
pub fn usage_line(command: Option<&str>) -> String {
    let mut cmd = Cli::command();
    cmd.build();
    let usage = match command.and_then(|c| cmd.find_subcommand_mut(c)) {
        Some(sub) => sub.render_usage(),
        None => cmd.render_usage(),
    };
    usage.to_string().trim_end().to_string()
}

/// The message of a clap parse error, first line only, without `error: `.
fn message(err: &clap::Error, command: Option<&str>) -> String {
    let arg = ctx(err, ContextKind::InvalidArg);
    let flag = arg.as_deref().map(flag_of).unwrap_or("?");
    let value = ctx(err, ContextKind::InvalidValue).unwrap_or_default();
    match err.kind() {
        ErrorKind::MissingRequiredArgument => {
            let missing: Vec<&str> = match err.get(ContextKind::InvalidArg) {
                Some(ContextValue::Strings(v)) => v.iter().map(|a| flag_of(a)).collect(),
                _ => vec![flag],
            };
            let s = if missing.len() > 1 { "s" } else { "" };
            format!("missing required flag{s} {}", missing.join(", "))
        }
        ErrorKind::MissingSubcommand | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            "no command given (one of quantize, dequantize, check, run, bench, info)".to_string()
        }
        ErrorKind::InvalidSubcommand => {
            let name = ctx(err, ContextKind::InvalidSubcommand).unwrap_or_default();
            format!("unknown command `{name}` (one of quantize, dequantize, check, run, bench, info, help)")
        }
        ErrorKind::UnknownArgument if flag.starts_with('-') => {
            let known = match command {
                None => "flags go after the command".to_string(),
                Some(c) => match flags_of(c) {
                    f if f.is_empty() => "it takes only the global --json, --quiet and -v".to_string(),
                    f => format!("it takes {}", f.join(", ")),
                },
            };
            let hint =
                ctx(err, ContextKind::SuggestedArg).map(|s| format!("; did you mean `{s}`?")).unwrap_or_default();
            match command {
                Some(c) => format!("unknown flag `{flag}` for `{c}` ({known}{hint})"),
                None => format!("unknown flag `{flag}` ({known}{hint})"),
            }
        }
        ErrorKind::UnknownArgument => format!("unexpected argument `{flag}` (flags are `--name value`)"),
        ErrorKind::InvalidValue if value.is_empty() => format!("flag `{flag}` needs a value"),
        ErrorKind::InvalidValue => match ctx(err, ContextKind::ValidValue) {
            Some(valid) => format!("`{flag}` is {} (got `{value}`)", valid.replace(", ", " or ")),
            None => format!("invalid value `{value}` for `{flag}`"),
        },
        ErrorKind::ValueValidation => {
            let why = std::error::Error::source(err).map(|e| e.to_string()).unwrap_or_default();
            format!("invalid value `{value}` for `{flag}`: {why}")
        }
        ErrorKind::ArgumentConflict => {
            let prior = ctx(err, ContextKind::PriorArg);
            match prior.as_deref().map(flag_of) {
                Some(p) if p == flag => format!("flag `{flag}` given twice"),
                Some(p) => format!("`{flag}` cannot be used with `{p}`"),
                None => format!("flag `{flag}` given twice"),
            }
        }
        ErrorKind::InvalidUtf8 => "an argument is not valid UTF-8".to_string(),
        _ => {
            // Anything else: clap's own first line.
            let text = err.to_string();
            let first = text.lines().next().unwrap_or("invalid arguments");
            first.strip_prefix("error: ").unwrap_or(first).to_string()
        }
    }
}

/// The whole stderr text of a usage error: `error: ...`, the `Usage:` line and where to read more.
pub fn render(msg: &str, command: Option<&str>) -> String {
    let more = match command {
        Some(c) => format!("nvfp4-moe {c} --help"),
        None => "nvfp4-moe --help".to_string(),
    };
    format!("error: {msg}\n\n{}\n\nRun `{more}` for details.", usage_line(command))
}

/// The stderr text of a clap parse error.
pub fn render_clap(err: &clap::Error, args: &[OsString]) -> String {
    let command = match err.kind() {
        ErrorKind::InvalidSubcommand | ErrorKind::MissingSubcommand => None,
        _ => typed_command(args),
    };
    render(&message(err, command), command)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    fn fails(args: &[&str]) -> (String, String) {
        let argv: Vec<OsString> =
            std::iter::once("nvfp4-moe").chain(args.iter().copied()).map(OsString::from).collect();
        let err = Cli::try_parse_from(&argv).expect_err("parsed");
        let text = render_clap(&err, &argv);
        let first = text.lines().next().unwrap().to_string();
        (first, text)
    }

    #[test]
    fn every_kind_names_the_flag() {
        let cases: &[(&[&str], &str)] = &[
            (&[], "error: no command given"),
            (&["frobnicate"], "error: unknown command `frobnicate`"),
            (&["help", "nope"], "error: unknown command `nope`"),
            (&["quantize"], "error: missing required flags --input, --tensor, --output"),
            (&["quantize", "--input", "a", "--output", "b"], "error: missing required flag --tensor"),
            (&["run", "--weights", "w"], "error: missing required flags --prefix, --input, --output"),
            (&["quantize", "--input", "a", "--tensor", "t", "--output", "b", "--bogus", "1"], "unknown flag `--bogus`"),
            (&["quantize", "--input", "a", "--tensor", "t", "--output"], "error: flag `--output` needs a value"),
            (&["quantize", "--input", "", "--tensor", "t", "--output", "o"], "error: flag `--input` needs a value"),
            (
                &["quantize", "--input", "a", "--input", "b", "--tensor", "t", "--output", "c"],
                "flag `--input` given twice",
            ),
            (&["quantize", "--backend", "tpu"], "error: `--backend` is cpu or cuda (got `tpu`)"),
            (&["quantize", "stray", "--input", "a"], "error: unexpected argument `stray`"),
            (
                &["dequantize", "--input", "a", "--output", "b", "--tensor", "x"],
                "unknown flag `--tensor` for `dequantize`",
            ),
            (&["info", "--verbose"], "error: unknown flag `--verbose` for `info`"),
            (&["check", "--tile", "n16"], "error: unknown flag `--tile` for `check`"),
            (
                &["bench", "--tile", "n12"],
                "error: `--tile` is auto or n8 or n16 or n32 or n64 or n128 or n256 or warp (got `n12`)",
            ),
            (&["bench", "--batch-invariant=yes"], "--batch-invariant"),
            (&["bench", "--intermediate", "fp8"], "error: `--intermediate` is bf16 or nvfp4 (got `fp8`)"),
            (&["check", "--tokens", "0"], "error: invalid value `0` for `--tokens`: must be at least 1"),
            (&["check", "--tokens", "5000"], "error: invalid value `5000` for `--tokens`: at most 4096"),
            (&["check", "--preset", "llama"], "error: invalid value `llama` for `--preset`: unknown preset `llama`"),
            (&["bench", "--preset", "kimi-k2,kimi-k2"], "preset `kimi-k2` given twice"),
            (&["bench", "--tokens", "1,,2"], "error: invalid value `1,,2` for `--tokens`"),
            (
                &["run", "--tile", "n48"],
                "error: `--tile` is auto or n8 or n16 or n32 or n64 or n128 or n256 or warp (got `n48`)",
            ),
        ];
        for (args, want) in cases {
            let (first, text) = fails(args);
            assert!(first.starts_with("error: ") && first.contains(want), "{args:?}: `{first}` lacks `{want}`");
            assert!(text.contains("\n\nUsage: nvfp4-moe"), "{args:?}: {text}");
        }
        // The usage line is the command's own.
        assert!(fails(&["quantize"]).1.contains("Usage: nvfp4-moe quantize [OPTIONS] --input <FILE>"));
        assert!(fails(&["frobnicate"]).1.contains("Usage: nvfp4-moe [OPTIONS] <COMMAND>"));
    }

    #[test]
    fn usage_errors_found_after_parsing() {
        let text = render("`--tokens` too large", Some("bench"));
        assert!(text.starts_with("error: `--tokens` too large\n\nUsage: nvfp4-moe bench"), "{text}");
        assert!(text.ends_with("Run `nvfp4-moe bench --help` for details."), "{text}");
    }
}
