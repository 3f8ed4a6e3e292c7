//! Names and paths as error messages show them. Tensor names, shard names and paths come from
//! files the crate did not write (a safetensors header, an index), so a message shows them escaped
//! (control characters, backticks and bytes that are not UTF-8 as `\u{..}` / `\xNN`: a name can
//! neither break a terminal nor fake the rest of a message) and shortened in the middle (a
//! megabyte-long name stays a one-line message). Messages never quote tensor data or a file's raw
//! JSON: they say what is wrong and where.

use std::path::Path;

/// The most characters a message shows of one name or path.
const MAX_SHOWN: usize = 160;
/// Of a shortened name: the characters kept from its start and its end.
const KEEP_HEAD: usize = 48;
const KEEP_TAIL: usize = 96;

fn push_escaped(out: &mut String, c: char) {
    if c.is_control() || c == '`' || c == '\u{feff}' || ('\u{200b}'..='\u{200f}').contains(&c) {
        out.extend(c.escape_unicode());
    } else {
        out.push(c);
    }
}

/// Escapes `pieces` (valid text, or single bytes that are not UTF-8) and shortens the result in
/// the middle to at most [`MAX_SHOWN`] characters plus a marker saying how much was left out.
fn escape_and_shorten(pieces: &[Piece<'_>]) -> String {
    let mut escaped = String::new();
    for p in pieces {
        match p {
            Piece::Text(s) => s.chars().for_each(|c| push_escaped(&mut escaped, c)),
            Piece::Byte(b) => escaped.push_str(&format!("\\x{b:02X}")),
        }
    }
    let count = escaped.chars().count();
    if count <= MAX_SHOWN {
        return escaped;
    }
    let head: String = escaped.chars().take(KEEP_HEAD).collect();
    let tail: String = escaped.chars().skip(count - KEEP_TAIL).collect();
    format!("{head}...({} characters left out)...{tail}", count - KEEP_HEAD - KEEP_TAIL)
}

enum Piece<'a> {
    Text(&'a str),
    Byte(u8),
}

/// A name from a file (tensor, shard, dtype), escaped and shortened for a message.
pub fn shown(name: &str) -> String {
    escape_and_shorten(&[Piece::Text(name)])
}

/// A path, escaped (bytes that are not UTF-8 as `\xNN`) and shortened for a message.
pub fn shown_path(path: &Path) -> String {
    let bytes = path.as_os_str().as_encoded_bytes();
    let mut pieces = Vec::new();
    for chunk in bytes.utf8_chunks() {
        pieces.push(Piece::Text(chunk.valid()));
        pieces.extend(chunk.invalid().iter().map(|&b| Piece::Byte(b)));
    }
    escape_and_shorten(&pieces)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_names_are_unchanged() {
        let n = "model.layers.3.mlp.experts.17.gate_proj.weight_scale_2";
        assert_eq!(shown(n), n);
        assert_eq!(
            shown_path(Path::new("/a/b c/model-00001-of-00002.safetensors")),
            "/a/b c/model-00001-of-00002.safetensors"
        );
        assert_eq!(shown("Qwen3-MoE/专家"), "Qwen3-MoE/专家");
    }

    #[test]
    fn control_characters_and_backticks_are_escaped() {
        assert_eq!(shown("a\nb"), "a\\u{a}b");
        assert_eq!(shown("x` and `y"), "x\\u{60} and \\u{60}y");
        assert_eq!(shown("\u{1b}[31mred"), "\\u{1b}[31mred");
        assert_eq!(shown("a\u{200b}b"), "a\\u{200b}b");
    }

    #[cfg(unix)]
    #[test]
    fn bytes_that_are_not_utf8_are_shown_as_hex() {
        use std::ffi::OsStr;
        use std::os::unix::ffi::OsStrExt;
        let p = Path::new(OsStr::from_bytes(b"/tmp/a\xFFb.safetensors"));
        assert_eq!(shown_path(p), "/tmp/a\\xFFb.safetensors");
    }

    #[test]
    fn long_names_are_shortened_in_the_middle() {
        let long = format!("start.{}.end", "x".repeat(1_000_000));
        let s = shown(&long);
        assert!(s.chars().count() < MAX_SHOWN + 40, "{}", s.len());
        assert!(s.starts_with("start.xx") && s.ends_with("xx.end"), "{s}");
        assert!(s.contains("characters left out"), "{s}");
        let exactly = "y".repeat(MAX_SHOWN);
        assert_eq!(shown(&exactly), exactly);
    }
}
