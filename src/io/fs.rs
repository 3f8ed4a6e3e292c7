//! Opening inputs and writing outputs safely.
//!
//! Inputs: only regular files are read ([`open_regular`]). A FIFO would block the reader until
//! some writer appears, `/dev/zero` never ends and a directory is not data, so each is refused with
//! [`Error::NotRegularFile`] before a byte is read. Symlinks are followed (a Hugging Face cache
//! snapshot is made of them); what they point to must be a regular file. On Unix the file is opened
//! non-blocking (a FIFO swapped in after the check cannot hang the open), then checked again on the
//! open descriptor.
//!
//! Outputs: every file the crate writes goes through [`write_atomically`]: the data goes to a new
//! file in the target's directory, created exclusively (`O_EXCL`, so it can never be a file or link
//! someone planted) under an unpredictable name short enough for any target name, is flushed to
//! disk, renamed over the target, and then the directory is synced, so a crash leaves either the
//! old file or the new one and never a mix. Only a regular file (or nothing) is replaced: an output
//! path naming a symlink, FIFO, socket, device or directory is an [`Error::NotRegularFile`] (as
//! root, `--output /dev/null` would otherwise replace `/dev/null` with a regular file). On any
//! error the temporary file is removed and the target is left as it was.

use std::fs::{File, FileType, OpenOptions};
use std::hash::{BuildHasher, Hasher};
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};
use crate::io::shown::shown_path;

/// What a path is, for [`Error::NotRegularFile`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FileKind {
    /// A regular file.
    Regular,
    /// A directory.
    Directory,
    /// A symbolic link (as an output: the crate does not write through links).
    Symlink,
    /// A named pipe.
    Fifo,
    /// A Unix domain socket.
    Socket,
    /// A character device such as `/dev/null` or `/dev/zero`.
    CharDevice,
    /// A block device.
    BlockDevice,
    /// Anything else the platform has.
    Other,
}

impl FileKind {
    /// The kind of a file type (as `symlink_metadata` or `metadata` report it).
    pub fn of(t: &FileType) -> FileKind {
        #[cfg(unix)]
        {
            use std::os::unix::fs::FileTypeExt;
            if t.is_fifo() {
                return FileKind::Fifo;
            }
            if t.is_socket() {
                return FileKind::Socket;
            }
            if t.is_char_device() {
                return FileKind::CharDevice;
            }
            if t.is_block_device() {
                return FileKind::BlockDevice;
            }
        }
        if t.is_symlink() {
            FileKind::Symlink
        } else if t.is_dir() {
            FileKind::Directory
        } else if t.is_file() {
            FileKind::Regular
        } else {
            FileKind::Other
        }
    }
}

impl std::fmt::Display for FileKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FileKind::Regular => "a regular file",
            FileKind::Directory => "a directory",
            FileKind::Symlink => "a symbolic link",
            FileKind::Fifo => "a named pipe (FIFO)",
            FileKind::Socket => "a socket",
            FileKind::CharDevice => "a character device",
            FileKind::BlockDevice => "a block device",
            FileKind::Other => "not a regular file",
        })
    }
}

/// An [`Error::Io`] naming the path (escaped) and what was being done.
pub(crate) fn io_err(action: &str, path: &Path, e: std::io::Error) -> Error {
    Error::Io(std::io::Error::new(e.kind(), format!("cannot {action} `{}`: {e}", shown_path(path))))
}

fn not_regular(path: &Path, kind: FileKind) -> Error {
    Error::NotRegularFile { path: path.to_path_buf(), kind }
}

/// Opens `path` for reading if it is (or links to) a regular file.
///
/// # Errors
/// [`Error::NotRegularFile`] for anything else (checked before and after opening, and never
/// blocking on a FIFO), [`Error::Io`] if it cannot be opened.
pub(crate) fn open_regular(path: &Path) -> Result<File> {
    let md = std::fs::metadata(path).map_err(|e| io_err("read", path, e))?;
    if !md.is_file() {
        return Err(not_regular(path, FileKind::of(&md.file_type())));
    }
    let mut options = OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        // A FIFO put in place between the check above and this open must not block it; reads of a
        // regular file ignore the flag.
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options.open(path).map_err(|e| io_err("open", path, e))?;
    let md = file.metadata().map_err(|e| io_err("read", path, e))?;
    if !md.is_file() {
        return Err(not_regular(path, FileKind::of(&md.file_type())));
    }
    Ok(file)
}

/// The whole of a small regular file (a config or an index), at most `limit` bytes.
///
/// # Errors
/// As [`open_regular`]; a file over `limit` bytes is an [`Error::Invalid`] (nothing is read).
pub(crate) fn read_small_file(path: &Path, limit: u64, what: &str) -> Result<Vec<u8>> {
    let file = open_regular(path)?;
    let len = file.metadata().map_err(|e| io_err("read", path, e))?.len();
    if len > limit {
        return Err(Error::Invalid(format!(
            "{what} `{}` has {len} bytes, more than the {limit} such a file can have",
            shown_path(path)
        )));
    }
    let mut out = Vec::with_capacity(len as usize);
    // `take` keeps a file that grows while being read within the limit.
    file.take(limit + 1).read_to_end(&mut out).map_err(|e| io_err("read", path, e))?;
    if out.len() as u64 > limit {
        return Err(Error::Invalid(format!("{what} `{}` grew past {limit} bytes while being read", shown_path(path))));
    }
    Ok(out)
}

/// Refuses a target that exists and is not a regular file (a symlink is not followed: it is
/// refused).
fn check_replaceable(target: &Path) -> Result<()> {
    match std::fs::symlink_metadata(target) {
        Ok(md) if md.file_type().is_file() => Ok(()),
        Ok(md) => Err(not_regular(target, FileKind::of(&md.file_type()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err("write", target, e)),
    }
}

/// 64 bits no other process can predict: std's `RandomState` keys SipHash with randomness from
/// the operating system, and the time, process id and a counter make each name differ.
pub(crate) fn unpredictable_u64() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    h.write_u128(nanos);
    h.finish()
}

/// The temporary file until it is renamed: removed on drop unless [`keep`](Self::keep) was called.
struct TempFile {
    path: PathBuf,
    armed: bool,
}

impl TempFile {
    fn keep(mut self) {
        self.armed = false;
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if self.armed {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// How often a name collision (a file already there under the random name) is retried.
const TEMP_ATTEMPTS: usize = 16;

/// Creates the temporary file in `dir`: `.nvfp4moe-<16 hex digits>.tmp`, 30 bytes whatever the
/// target's name (a target name of up to 255 bytes, the usual limit, stays writable).
fn create_temp(dir: &Path, target: &Path) -> Result<(File, TempFile)> {
    for _ in 0..TEMP_ATTEMPTS {
        let path = dir.join(format!(".nvfp4moe-{:016x}.tmp", unpredictable_u64()));
        let mut options = OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            // The permissions any new file gets here (0666 minus the umask), as the target had
            // it been created directly; O_NOFOLLOW on top of O_EXCL for clarity.
            options.mode(0o666).custom_flags(libc::O_NOFOLLOW);
        }
        match options.open(&path) {
            Ok(f) => return Ok((f, TempFile { path, armed: true })),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(io_err("create a temporary file beside", target, e)),
        }
    }
    Err(io_err(
        "create a temporary file beside",
        target,
        std::io::Error::new(std::io::ErrorKind::AlreadyExists, "every random name tried was taken"),
    ))
}

/// Writes a file safely (see the module docs): `fill` writes the contents into a buffered
/// writer, then the data is synced, renamed over `target` and the directory synced.
///
/// # Errors
/// [`Error::NotRegularFile`] if `target` exists and is not a regular file (symlinks included),
/// [`Error::Io`] for a failed create, write, sync or rename (naming `target`), or the error
/// `fill` returns. On every error the temporary file is removed and `target` is unchanged.
pub(crate) fn write_atomically(target: &Path, fill: impl FnOnce(&mut BufWriter<&File>) -> Result<()>) -> Result<()> {
    if target.file_name().is_none() {
        return Err(io_err(
            "write",
            target,
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "the path does not end in a file name"),
        ));
    }
    check_replaceable(target)?;
    let dir = match target.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let (file, temp) = create_temp(&dir, target)?;
    let io = |e: std::io::Error| io_err("write", target, e);
    {
        let mut w = BufWriter::with_capacity(1 << 20, &file);
        fill(&mut w)?;
        w.flush().map_err(io)?;
    }
    file.sync_all().map_err(io)?;
    drop(file);
    // Checked again right before the rename: a symlink or device put there while the data was
    // being written is refused too (rename replaces the directory entry, never writes through it).
    check_replaceable(target)?;
    std::fs::rename(&temp.path, target).map_err(io)?;
    temp.keep();
    sync_dir(&dir).map_err(|e| io_err("sync the directory of", target, e))
}

/// Writes `bytes` to `target` the way the crate writes every file: into a new file in `target`'s
/// directory, created exclusively under an unpredictable 30-byte name, synced, renamed over
/// `target`, then the directory synced. Only a regular file (or nothing) is replaced; on any error
/// the temporary file is removed and `target` is left as it was.
///
/// # Errors
/// [`Error::NotRegularFile`] if `target` exists and is not a regular file (a symlink included),
/// [`Error::Io`] for a failed create, write, sync or rename (naming `target`).
pub fn write_file_atomically(target: impl AsRef<Path>, bytes: &[u8]) -> Result<()> {
    let target = target.as_ref();
    write_atomically(target, |w| w.write_all(bytes).map_err(|e| io_err("write", target, e)))
}

/// Makes a rename in `dir` durable. Filesystems that cannot sync a directory say so with
/// `EINVAL`; nothing more can be done there, so that is not an error.
pub(crate) fn sync_dir(dir: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        match File::open(dir).and_then(|d| d.sync_all()) {
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(()),
            r => r,
        }
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// A fresh directory, removed on drop.
    struct Dir(PathBuf);

    impl Dir {
        fn new(tag: &str) -> Dir {
            let p = std::env::temp_dir().join(format!(
                "nvfp4moe-fs-{}-{:016x}-{tag}",
                std::process::id(),
                unpredictable_u64()
            ));
            std::fs::create_dir_all(&p).unwrap();
            Dir(p)
        }

        /// Every entry (links not followed) and, for regular files, the bytes.
        fn snapshot(&self) -> BTreeMap<String, (FileKind, Vec<u8>)> {
            std::fs::read_dir(&self.0)
                .unwrap()
                .map(|e| {
                    let e = e.unwrap();
                    let kind = FileKind::of(&e.file_type().unwrap());
                    let bytes = if kind == FileKind::Regular { std::fs::read(e.path()).unwrap() } else { vec![] };
                    (e.file_name().to_string_lossy().into_owned(), (kind, bytes))
                })
                .collect()
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn writes_and_replaces_regular_files() {
        let d = Dir::new("ok");
        let target = d.0.join("out.json");
        write_file_atomically(&target, b"first").unwrap();
        write_file_atomically(&target, b"second").unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"second");
        // Nothing but the target is left.
        assert_eq!(d.snapshot().keys().collect::<Vec<_>>(), ["out.json"]);
        // A relative bare name works (its directory is `.`): checked through the directory logic.
        assert_eq!(
            match Path::new("x.json").parent() {
                Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
                _ => PathBuf::from("."),
            },
            PathBuf::from(".")
        );
    }

    #[test]
    fn long_names_fit_the_file_name_limit() {
        let d = Dir::new("long");
        for len in [250, 255] {
            let name = format!("{}.safetensors", "n".repeat(len - ".safetensors".len()));
            assert_eq!(name.len(), len);
            write_file_atomically(d.0.join(&name), b"data").unwrap();
            assert_eq!(std::fs::read(d.0.join(&name)).unwrap(), b"data");
        }
        assert_eq!(d.snapshot().len(), 2);
    }

    #[test]
    fn a_failing_writer_leaves_nothing_behind() {
        let d = Dir::new("fail");
        let target = d.0.join("out.safetensors");
        std::fs::write(&target, b"old contents").unwrap();
        let before = d.snapshot();
        let e = write_atomically(&target, |w| {
            w.write_all(&[7u8; 3 << 20]).unwrap();
            Err(Error::Invalid("the writer gave up".into()))
        })
        .unwrap_err();
        assert!(e.to_string().contains("gave up"), "{e}");
        assert_eq!(d.snapshot(), before);
    }

    #[test]
    fn a_missing_directory_is_an_io_error_naming_the_target() {
        let d = Dir::new("nodir");
        let target = d.0.join("no").join("such").join("out.json");
        match write_file_atomically(&target, b"x").unwrap_err() {
            Error::Io(e) => assert!(e.to_string().contains("out.json"), "{e}"),
            e => panic!("expected Error::Io, got {e:?}"),
        }
    }

    #[cfg(unix)]
    #[test]
    fn only_regular_files_are_replaced() {
        use std::os::unix::ffi::OsStrExt;
        use std::os::unix::fs::symlink;
        let d = Dir::new("refuse");
        let victim = d.0.join("victim.txt");
        std::fs::write(&victim, b"must not change").unwrap();
        let link = d.0.join("link.safetensors");
        symlink(&victim, &link).unwrap();
        let dangling = d.0.join("dangling.safetensors");
        symlink(d.0.join("nowhere"), &dangling).unwrap();
        let fifo = d.0.join("pipe.safetensors");
        let c = std::ffi::CString::new(fifo.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let sub = d.0.join("subdir");
        std::fs::create_dir(&sub).unwrap();
        // A device node: made here when allowed (as root), else /dev/null itself, which a
        // non-root user cannot replace anyway (the refusal must come first all the same).
        let node = d.0.join("null-device");
        let c = std::ffi::CString::new(node.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path; makedev(1, 3) is the null device.
        let made = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) } == 0;
        let device = if made { node } else { PathBuf::from("/dev/null") };
        let before = d.snapshot();
        let dev_before = std::fs::symlink_metadata(&device).unwrap();
        for (target, kind) in [
            (&link, FileKind::Symlink),
            (&dangling, FileKind::Symlink),
            (&fifo, FileKind::Fifo),
            (&sub, FileKind::Directory),
            (&device, FileKind::CharDevice),
        ] {
            match write_file_atomically(target, b"new data") {
                Err(Error::NotRegularFile { path, kind: k }) => {
                    assert_eq!((&path, k), (target, kind));
                    let msg = Error::NotRegularFile { path, kind: k }.to_string();
                    assert!(msg.contains("not a regular file"), "{msg}");
                }
                other => panic!("{}: expected NotRegularFile, got {other:?}", target.display()),
            }
            assert_eq!(d.snapshot(), before, "{}", target.display());
        }
        let dev_after = std::fs::symlink_metadata(&device).unwrap();
        assert!(FileKind::of(&dev_after.file_type()) == FileKind::CharDevice);
        assert_eq!(dev_before.len(), dev_after.len());
        assert_eq!(std::fs::read(&victim).unwrap(), b"must not change");
    }

    #[test]
    fn temporary_names_are_short_and_differ() {
        let a = unpredictable_u64();
        let b = unpredictable_u64();
        assert_ne!(a, b);
        assert_eq!(format!(".nvfp4moe-{a:016x}.tmp").len(), 30);
    }
}
