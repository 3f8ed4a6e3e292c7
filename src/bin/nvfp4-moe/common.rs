//! What every subcommand shares: the failure type and exit codes, stdout output (text or JSON),
//! diagnostics through `tracing` and progress bars on stderr, number formatting, and the CPU
//! work splitter.

use std::fmt;
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use nvfp4_moe::Error;
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, MakeWriter};
use tracing_subscriber::registry::LookupSpan;

/// Why a command failed: a usage error (exit 2) or a failure while running (exit 1).
#[derive(Debug)]
pub enum Fail {
    /// Bad arguments that parsing alone cannot see (e.g. a value too large for a preset), found
    /// by `command`.
    Usage { msg: String, command: &'static str },
    /// Anything that went wrong while running.
    Run(String),
}

impl From<Error> for Fail {
    fn from(e: Error) -> Self {
        Fail::Run(e.to_string())
    }
}

#[cfg(feature = "cuda")]
impl From<cudarc::driver::DriverError> for Fail {
    fn from(e: cudarc::driver::DriverError) -> Self {
        Fail::from(Error::from(e))
    }
}

/// A command's result.
pub type CliResult<T = ()> = std::result::Result<T, Fail>;

/// A usage error of `command` found after parsing.
pub fn usage(command: &'static str, msg: impl fmt::Display) -> Fail {
    Fail::Usage { msg: msg.to_string(), command }
}

/// The flags every subcommand takes.
#[derive(Clone, Copy, Debug, Default)]
pub struct Global {
    /// Print the result as one JSON document on stdout instead of text.
    pub json: bool,
}

/// Prints one line of the text result on stdout; a closed pipe (`| head`) is not worth a panic.
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}
pub(crate) use out;

/// Prints the JSON result on stdout (pretty, one document, a final newline).
pub fn print_json(v: &serde_json::Value) {
    let mut s = serde_json::to_string_pretty(v).unwrap_or_default();
    s.push('\n');
    let _ = std::io::stdout().write_all(s.as_bytes());
}

// ------------------------------------------------------------------------------------------------
// Diagnostics (tracing) and progress (indicatif), both on stderr

/// Whether progress bars may draw: stderr is a terminal and `--quiet` was not given.
static PROGRESS: AtomicBool = AtomicBool::new(false);

/// Every bar lives here, so that a diagnostic line can be printed above them without tearing.
fn bars() -> &'static MultiProgress {
    static BARS: OnceLock<MultiProgress> = OnceLock::new();
    BARS.get_or_init(|| {
        let target = if PROGRESS.load(Ordering::Relaxed) {
            ProgressDrawTarget::stderr_with_hz(10)
        } else {
            ProgressDrawTarget::hidden()
        };
        MultiProgress::with_draw_target(target)
    })
}

/// One diagnostic line on stderr: `error: `, `warning: ` or (at `-v`) `debug: ` before the
/// message; info lines (timings, notes that begin with `note:`) as they are.
struct LineFormat;

impl<S, N> FormatEvent<S, N> for LineFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut w: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        let prefix = match *event.metadata().level() {
            Level::ERROR => "error: ",
            Level::WARN => "warning: ",
            Level::INFO => "",
            Level::DEBUG => "debug: ",
            Level::TRACE => "trace: ",
        };
        w.write_str(prefix)?;
        ctx.field_format().format_fields(w.by_ref(), event)?;
        writeln!(w)
    }
}

/// stderr for tracing: each event is written whole, with the progress bars lifted out of the way.
struct StderrAboveBars(Vec<u8>);

impl Write for StderrAboveBars {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        if !self.0.is_empty() {
            let buf = std::mem::take(&mut self.0);
            bars().suspend(|| std::io::stderr().lock().write_all(&buf))?;
        }
        Ok(())
    }
}

impl Drop for StderrAboveBars {
    fn drop(&mut self) {
        let _ = self.flush();
    }
}

struct MakeStderr;

impl<'a> MakeWriter<'a> for MakeStderr {
    type Writer = StderrAboveBars;
    fn make_writer(&'a self) -> Self::Writer {
        StderrAboveBars(Vec::new())
    }
}

/// Sets up diagnostics: warnings and errors always, info unless `quiet`, debug with `verbose`.
/// Progress bars draw only when stderr is a terminal (and not `quiet`).
pub fn init_diagnostics(quiet: bool, verbose: u8) {
    PROGRESS.store(!quiet && std::io::stderr().is_terminal(), Ordering::Relaxed);
    let level = match (quiet, verbose) {
        (true, _) => Level::WARN,
        (false, 0) => Level::INFO,
        (false, 1) => Level::DEBUG,
        _ => Level::TRACE,
    };
    let _ = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_ansi(false)
        .event_format(LineFormat)
        .with_writer(MakeStderr)
        .try_init();
}

/// Prints a line on stderr above the progress bars (for the final `error:` line).
pub fn eprint_line(line: &str) {
    bars().suspend(|| {
        let _ = writeln!(std::io::stderr().lock(), "{line}");
    });
}

/// A progress bar that is cleared when dropped (so an error leaves no bar behind).
pub struct Bar(ProgressBar);

impl std::ops::Deref for Bar {
    type Target = ProgressBar;
    fn deref(&self) -> &ProgressBar {
        &self.0
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        if !self.0.is_finished() {
            self.0.finish_and_clear();
        }
    }
}

/// A progress bar of `len` units (`unit`: "rows", "tokens", "cases") for `what`, hidden when
/// stderr is not a terminal.
pub fn progress(what: &str, len: u64, unit: &str) -> Bar {
    let style = ProgressStyle::with_template(&format!(
        "{{msg}} [{{bar:30}}] {{pos}}/{{len}} {unit} ({{percent}}%, {{elapsed}}, eta {{eta}})"
    ))
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ");
    let pb = bars().add(ProgressBar::new(len).with_style(style).with_message(what.to_string()));
    pb.enable_steady_tick(Duration::from_millis(200));
    Bar(pb)
}

/// A progress bar over `len` bytes for `what`, with the rate and ETA, hidden when stderr is not a
/// terminal.
pub fn progress_bytes(what: &str, len: u64) -> Bar {
    let style = ProgressStyle::with_template(
        "{msg} [{bar:30}] {bytes}/{total_bytes} ({percent}%, {binary_bytes_per_sec}, {elapsed}, eta {eta})",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ");
    let pb = bars().add(ProgressBar::new(len).with_style(style).with_message(what.to_string()));
    pb.enable_steady_tick(Duration::from_millis(200));
    Bar(pb)
}

/// A spinner for work of unknown length (loading, uploading), hidden when stderr is not a
/// terminal.
pub fn spinner(what: &str) -> Bar {
    let style = ProgressStyle::with_template("{spinner} {msg} ({elapsed})")
        .unwrap_or_else(|_| ProgressStyle::default_spinner());
    let pb = bars().add(ProgressBar::new_spinner().with_style(style).with_message(what.to_string()));
    pb.enable_steady_tick(Duration::from_millis(100));
    Bar(pb)
}

// ------------------------------------------------------------------------------------------------
// Formatting

/// A float for people: plain between 1e-3 and 1e4, else scientific (both exact round trips).
pub fn fmt_f32(v: f32) -> String {
    if v == 0.0 || (1e-3..1e4).contains(&v.abs()) {
        format!("{v}")
    } else {
        format!("{v:e}")
    }
}

/// A duration for people (`1.25 s`, `3.1 ms`, `40 us`).
pub fn fmt_dur(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s >= 1.0 {
        format!("{s:.2} s")
    } else if s >= 1e-3 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{:.0} us", s * 1e6)
    }
}

/// A byte count for people (`1.50 GiB`, `3.0 MiB`, `12 B`).
pub fn fmt_bytes(n: usize) -> String {
    let n = n as f64;
    if n >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", n / (1u64 << 30) as f64)
    } else if n >= (1 << 20) as f64 {
        format!("{:.1} MiB", n / (1 << 20) as f64)
    } else if n >= 1024.0 {
        format!("{:.1} KiB", n / 1024.0)
    } else {
        format!("{n} B")
    }
}

/// `[a, b, c]`.
pub fn shape_text(shape: &[usize]) -> String {
    format!("[{}]", shape.iter().map(usize::to_string).collect::<Vec<_>>().join(", "))
}

/// One written tensor, for the text and JSON results.
pub fn tensor_json(name: &str, dtype: &str, shape: &[usize]) -> serde_json::Value {
    serde_json::json!({ "name": name, "dtype": dtype, "shape": shape })
}

/// `--prefix` with a final '.' added when missing ("" stays "").
pub fn normalize_prefix(p: Option<&str>) -> String {
    match p {
        None | Some("") => String::new(),
        Some(p) if p.ends_with('.') => p.to_string(),
        Some(p) => format!("{p}."),
    }
}

/// Adds the file to a safetensors parse error, which does not name it.
pub fn file_ctx(path: &str) -> impl Fn(Error) -> Fail + '_ {
    move |e| match e {
        Error::Safetensors(s) => Fail::Run(format!("`{path}` is not a valid safetensors file: {s}")),
        e => Fail::from(e),
    }
}

// ------------------------------------------------------------------------------------------------
// CPU work on all cores

/// The worker threads to use: every core.
pub fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Runs `work` on every item (`(units in it, item)`) on all cores, advancing `pb` by each item's
/// units. Stops at, and returns, the first error (the library's work queue).
pub fn run_chunked<T: Send, E: Send>(
    pb: &ProgressBar,
    items: Vec<(usize, T)>,
    work: impl Fn(T) -> std::result::Result<(), E> + Sync,
) -> std::result::Result<(), E> {
    nvfp4_moe::convert::run_parallel(threads(), items, |(n, item)| {
        work(item)?;
        pb.inc(n as u64);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(fmt_f32(0.5), "0.5");
        assert_eq!(fmt_f32(1e-5), "1e-5");
        assert_eq!(fmt_dur(Duration::from_millis(1500)), "1.50 s");
        assert_eq!(fmt_dur(Duration::from_micros(2500)), "2.5 ms");
        assert_eq!(fmt_dur(Duration::from_micros(40)), "40 us");
        assert_eq!(fmt_bytes(12), "12 B");
        assert_eq!(fmt_bytes(3 << 20), "3.0 MiB");
        assert_eq!(shape_text(&[2, 3]), "[2, 3]");
        assert_eq!(normalize_prefix(None), "");
        assert_eq!(normalize_prefix(Some("")), "");
        assert_eq!(normalize_prefix(Some("a.b")), "a.b.");
        assert_eq!(normalize_prefix(Some("e.7.")), "e.7.");
    }

    #[test]
    fn chunked_work_runs_every_item_and_stops_at_an_error() {
        let pb = ProgressBar::hidden();
        let sum = std::sync::atomic::AtomicUsize::new(0);
        let items: Vec<(usize, usize)> = (0..100).map(|i| (1, i)).collect();
        run_chunked::<_, String>(&pb, items, |i| {
            sum.fetch_add(i, Ordering::Relaxed);
            Ok(())
        })
        .unwrap();
        assert_eq!(sum.into_inner(), 4950);
        assert_eq!(pb.position(), 100);
        let items: Vec<(usize, usize)> = (0..100).map(|i| (1, i)).collect();
        let e = run_chunked(&pb, items, |i| if i == 37 { Err(format!("item {i}")) } else { Ok(()) });
        assert_eq!(e, Err("item 37".to_string()));
    }
}
