//! Generates the Rust side of `cpp/include/nvfp4moe/types.h`, the one declaration of every type
//! that crosses the FFI: the constants, the enums (`#[repr(i32)]`, variants without the `k`) and
//! the launch argument structs (`#[repr(C)]`, device pointers as `u64`), plus layout checks on both
//! sides: `const` asserts that rustc's layout is the one computed here by C's rules, and a C++ file
//! of `static_assert`s that the C++ compiler's sizes, offsets and enumerator values are too. A
//! header edit regenerates everything; a stale or hand-edited copy fails the build.
//!
//! Used by `build.rs` (as a `#[path]` module) and by the `drift` tests of `src/abi.rs`, which check that the C++ checks
//! reject a header that drifted from the generated Rust.

use std::fmt::Write as _;

/// One `NVFP4MOE_CONST`.
#[derive(Debug, Clone)]
pub struct Const {
    pub name: String,
    pub value: i64,
    pub doc: Vec<String>,
}

/// One `NVFP4MOE_ENUM`.
#[derive(Debug, Clone)]
pub struct Enum {
    pub name: String,
    pub doc: Vec<String>,
    /// (C++ name, value, doc)
    pub variants: Vec<(String, i64, Vec<String>)>,
}

/// A field type in the header's grammar.
#[derive(Debug, Clone, PartialEq)]
pub enum FieldType {
    I64,
    I32,
    F32,
    Enum(String),
    /// A device address (any pointer type).
    Ptr(String),
}

impl FieldType {
    fn size_align(&self) -> (usize, usize) {
        match self {
            FieldType::I64 | FieldType::Ptr(_) => (8, 8),
            FieldType::I32 | FieldType::F32 | FieldType::Enum(_) => (4, 4),
        }
    }
    fn rust(&self) -> String {
        match self {
            FieldType::I64 => "i64".into(),
            FieldType::I32 => "i32".into(),
            FieldType::F32 => "f32".into(),
            FieldType::Enum(e) => e.clone(),
            FieldType::Ptr(_) => "u64".into(),
        }
    }
}

/// One field of an `NVFP4MOE_STRUCT`.
#[derive(Debug, Clone)]
pub struct Field {
    pub name: String,
    pub ty: FieldType,
    /// The `NVFP4MOE_INIT(...)` value, empty for "zero".
    pub init: String,
    pub doc: Vec<String>,
}

/// One `NVFP4MOE_STRUCT`.
#[derive(Debug, Clone)]
pub struct Struct {
    pub name: String,
    pub doc: Vec<String>,
    pub fields: Vec<Field>,
}

impl Struct {
    /// (offset of each field, size, align) by C's layout rules.
    pub fn layout(&self) -> (Vec<usize>, usize, usize) {
        let (mut off, mut max_align, mut offsets) = (0usize, 1usize, Vec::new());
        for f in &self.fields {
            let (s, a) = f.ty.size_align();
            off = off.div_ceil(a) * a;
            offsets.push(off);
            off += s;
            max_align = max_align.max(a);
        }
        (offsets, off.div_ceil(max_align) * max_align, max_align)
    }
}

/// Everything between `NVFP4MOE_ABI_BEGIN` and `NVFP4MOE_ABI_END`.
#[derive(Debug, Clone, Default)]
pub struct Abi {
    pub consts: Vec<Const>,
    pub enums: Vec<Enum>,
    pub structs: Vec<Struct>,
}

fn inner<'a>(s: &'a str, open: &str) -> Option<(&'a str, &'a str)> {
    let rest = s.strip_prefix(open)?;
    let close = rest.find(')')?;
    Some((&rest[..close], &rest[close + 1..]))
}

fn split_comment(line: &str) -> (&str, Option<String>) {
    match line.find("//") {
        Some(i) => (line[..i].trim(), Some(line[i + 2..].trim().to_string())),
        None => (line.trim(), None),
    }
}

/// Parses the header. Errors name the line that breaks the grammar.
pub fn parse(header: &str) -> Result<Abi, String> {
    let begin = header.find("NVFP4MOE_ABI_BEGIN").ok_or("no NVFP4MOE_ABI_BEGIN marker")?;
    let end = header.find("NVFP4MOE_ABI_END").ok_or("no NVFP4MOE_ABI_END marker")?;
    let body = &header[begin..end];
    let mut abi = Abi::default();
    let mut doc: Vec<String> = Vec::new();
    enum In {
        Top,
        Enum(Enum),
        Struct(Struct),
    }
    let mut state = In::Top;
    // Skip the marker's own line.
    for (n, raw) in body.lines().enumerate().skip(1) {
        let err = |what: &str| format!("types.h ABI section line {}: {what}: `{}`", n + 1, raw.trim());
        let (code, comment) = split_comment(raw);
        if code.is_empty() {
            match comment {
                Some(c) => doc.push(c),
                None => doc.clear(),
            }
            continue;
        }
        if code.starts_with("/*") {
            continue;
        }
        let mut item_doc = std::mem::take(&mut doc);
        item_doc.extend(comment);
        state = match state {
            In::Top => {
                if let Some((args, rest)) = inner(code, "NVFP4MOE_CONST(") {
                    let (name, value) = args.split_once(',').ok_or_else(|| err("NVFP4MOE_CONST(NAME, value)"))?;
                    if rest.trim() != ";" {
                        return Err(err("expected `;`"));
                    }
                    let value = value.trim().parse().map_err(|_| err("integer value"))?;
                    abi.consts.push(Const { name: name.trim().into(), value, doc: item_doc });
                    In::Top
                } else if let Some((name, rest)) = inner(code, "NVFP4MOE_ENUM(") {
                    if rest.trim() != "{" {
                        return Err(err("expected `{`"));
                    }
                    In::Enum(Enum { name: name.trim().into(), doc: item_doc, variants: vec![] })
                } else if let Some((name, rest)) = inner(code, "NVFP4MOE_STRUCT(") {
                    if rest.trim() != "{" {
                        return Err(err("expected `{`"));
                    }
                    In::Struct(Struct { name: name.trim().into(), doc: item_doc, fields: vec![] })
                } else {
                    return Err(err("not NVFP4MOE_CONST / NVFP4MOE_ENUM / NVFP4MOE_STRUCT"));
                }
            }
            In::Enum(mut e) => {
                if code == "};" {
                    abi.enums.push(e);
                    In::Top
                } else {
                    let (args, rest) =
                        inner(code, "NVFP4MOE_ENUMERATOR(").ok_or_else(|| err("expected an enumerator"))?;
                    if rest.trim() != "," {
                        return Err(err("expected `,` after the enumerator"));
                    }
                    let parts: Vec<&str> = args.split(',').map(str::trim).collect();
                    if parts.len() != 3 || parts[0] != e.name || !parts[1].starts_with('k') {
                        return Err(err("NVFP4MOE_ENUMERATOR(Enum, kName, value)"));
                    }
                    let v = parts[2].parse().map_err(|_| err("integer value"))?;
                    e.variants.push((parts[1].into(), v, item_doc));
                    In::Enum(e)
                }
            }
            In::Struct(mut s) => {
                if code == "};" {
                    abi.structs.push(s);
                    In::Top
                } else {
                    let code = code.strip_suffix(';').ok_or_else(|| err("expected `;`"))?;
                    let (decl, init) = match code.find("NVFP4MOE_INIT(") {
                        Some(i) => {
                            let init =
                                code[i + "NVFP4MOE_INIT(".len()..].strip_suffix(')').ok_or_else(|| err("INIT"))?;
                            (code[..i].trim(), init.trim().to_string())
                        }
                        None => return Err(err("every field has NVFP4MOE_INIT(...)")),
                    };
                    let name_at =
                        decl.rfind(|c: char| !(c.is_alphanumeric() || c == '_')).ok_or_else(|| err("field"))?;
                    let (ty, name) = (decl[..=name_at].trim(), decl[name_at + 1..].trim());
                    let ty = match ty {
                        "int64_t" => FieldType::I64,
                        "int32_t" => FieldType::I32,
                        "float" => FieldType::F32,
                        "const void*"
                        | "void*"
                        | "const int*"
                        | "int*"
                        | "const float*"
                        | "float*"
                        | "unsigned long long*" => FieldType::Ptr(ty.into()),
                        t => match inner(t, "NVFP4MOE_ENUM_T(") {
                            Some((e, "")) if abi.enums.iter().any(|x| x.name == e.trim()) => {
                                FieldType::Enum(e.trim().into())
                            }
                            _ => return Err(err("unknown field type")),
                        },
                    };
                    s.fields.push(Field { name: name.into(), ty, init, doc: item_doc });
                    In::Struct(s)
                }
            }
        };
    }
    if !matches!(state, In::Top) {
        return Err("types.h: unterminated enum or struct".into());
    }
    Ok(abi)
}

fn rust_variant(cxx: &str) -> &str {
    &cxx[1..]
}

fn rust_const(name: &str) -> String {
    // kExpertLimit -> EXPERT_LIMIT
    let mut out = String::new();
    for (i, c) in name[1..].chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

/// Writes `doc` as `///` lines. Brackets outside code spans are escaped: the header's shapes
/// (`bf16 [rows, cols]`) are not links.
fn docs(out: &mut String, indent: &str, doc: &[String]) {
    for d in doc {
        let mut line = String::new();
        let mut in_code = false;
        for c in d.chars() {
            match c {
                '`' => in_code = !in_code,
                '[' | ']' if !in_code => line.push('\\'),
                _ => {}
            }
            line.push(c);
        }
        let _ = writeln!(out, "{indent}/// {line}");
    }
}

/// The enums and constants (no CUDA needed).
pub fn rust_types(abi: &Abi) -> String {
    let mut o = String::from("// @generated by codegen/abi.rs from cpp/include/nvfp4moe/types.h: edit the header.\n\n");
    for c in &abi.consts {
        docs(&mut o, "", &c.doc);
        let _ = writeln!(o, "pub const {}: usize = {};\n", rust_const(&c.name), c.value);
    }
    for e in &abi.enums {
        docs(&mut o, "", &e.doc);
        let _ = writeln!(o, "#[repr(i32)]\n#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]\npub enum {} {{", e.name);
        for (v, val, doc) in &e.variants {
            docs(&mut o, "    ", doc);
            let _ = writeln!(o, "    {} = {},", rust_variant(v), val);
        }
        let _ = writeln!(o, "}}\n");
        let _ = writeln!(o, "impl {} {{", e.name);
        let _ = writeln!(
            o,
            "    /// Every variant, in declaration order.\n    pub const ALL: [{0}; {1}] = [",
            e.name,
            e.variants.len()
        );
        for (v, _, _) in &e.variants {
            let _ = writeln!(o, "        {}::{},", e.name, rust_variant(v));
        }
        let _ = writeln!(o, "    ];\n");
        let _ = writeln!(o, "    /// The variant whose C value is `v`.\n    pub const fn from_raw(v: i32) -> Option<Self> {{\n        match v {{");
        for (v, val, _) in &e.variants {
            let _ = writeln!(o, "            {val} => Some({}::{}),", e.name, rust_variant(v));
        }
        let _ = writeln!(o, "            _ => None,\n        }}\n    }}\n\n    /// The C++ enumerator's name.\n    pub const fn cxx_name(self) -> &'static str {{\n        match self {{");
        for (v, _, _) in &e.variants {
            let _ = writeln!(o, "            {}::{} => \"{v}\",", e.name, rust_variant(v));
        }
        let _ = writeln!(o, "        }}\n    }}\n}}\n");
    }
    o
}

/// The argument structs with their layout asserts and `cxx::ExternType` impls (the `cuda` side).
pub fn rust_structs(abi: &Abi) -> String {
    let mut o = String::from("// @generated by codegen/abi.rs from cpp/include/nvfp4moe/types.h: edit the header.\n\n");
    for s in &abi.structs {
        let (offsets, size, align) = s.layout();
        docs(&mut o, "", &s.doc);
        let _ = writeln!(o, "#[repr(C)]\n#[derive(Clone, Copy, Debug, PartialEq)]\npub struct {} {{", s.name);
        for f in &s.fields {
            docs(&mut o, "    ", &f.doc);
            if let FieldType::Ptr(p) = &f.ty {
                let _ = writeln!(o, "    ///\n    /// Device address (`{p}` in C).");
            }
            let _ = writeln!(o, "    pub {}: {},", f.name, f.ty.rust());
        }
        let _ = writeln!(o, "}}\n");
        let _ = writeln!(o, "impl Default for {} {{\n    fn default() -> Self {{\n        {} {{", s.name, s.name);
        for f in &s.fields {
            let v = match (&f.ty, f.init.as_str()) {
                (FieldType::Enum(e), "") => {
                    let first = abi.enums.iter().find(|x| &x.name == e).unwrap();
                    let zero =
                        first.variants.iter().find(|v| v.1 == 0).expect("an enum field's default is its 0 variant");
                    format!("{e}::{}", rust_variant(&zero.0))
                }
                (FieldType::F32, "") => "0.0".into(),
                (FieldType::F32, v) => v.trim_end_matches('f').to_string(),
                (_, "") => "0".into(),
                (_, v) => v.to_string(),
            };
            let _ = writeln!(o, "            {}: {v},", f.name);
        }
        let _ = writeln!(o, "        }}\n    }}\n}}\n");
        let _ = writeln!(o, "const _: () = assert!(::std::mem::size_of::<{}>() == {size});", s.name);
        let _ = writeln!(o, "const _: () = assert!(::std::mem::align_of::<{}>() == {align});", s.name);
        for (f, off) in s.fields.iter().zip(&offsets) {
            let _ = writeln!(o, "const _: () = assert!(::std::mem::offset_of!({}, {}) == {off});", s.name, f.name);
        }
        let _ = writeln!(
            o,
            "\n// SAFETY: a plain C struct (no constructor, destructor or self-reference): trivially movable.\nunsafe impl cxx::ExternType for {0} {{\n    type Id = cxx::type_id!(\"nvfp4moe::{0}\");\n    type Kind = cxx::kind::Trivial;\n}}\n",
            s.name
        );
    }
    o
}

/// `static_assert`s of the generated layout and values, compiled against the header by the C++
/// compiler.
pub fn cxx_checks(abi: &Abi, include: &str) -> String {
    let mut o = format!(
        "// @generated by codegen/abi.rs: the Rust side's view of nvfp4moe/types.h, checked by the C++ compiler.\n#include \"{include}\"\n#include <cstddef>\n#include <cstdint>\n\nstatic_assert(sizeof(void*) == 8, \"device addresses cross as u64\");\n"
    );
    for c in &abi.consts {
        let _ = writeln!(o, "static_assert(::nvfp4moe::{} == {}, \"{} changed: rebuild\");", c.name, c.value, c.name);
    }
    for e in &abi.enums {
        let _ = writeln!(o, "static_assert(sizeof(::nvfp4moe::{0}) == 4, \"{0}: int32_t\");", e.name);
        for (v, val, _) in &e.variants {
            let _ = writeln!(
                o,
                "static_assert(static_cast<int32_t>(::nvfp4moe::{0}::{v}) == {val}, \"{0}::{v} disagrees with the generated Rust\");",
                e.name
            );
        }
    }
    for s in &abi.structs {
        let (offsets, size, align) = s.layout();
        let _ = writeln!(o, "static_assert(sizeof(::nvfp4moe::{0}) == {size} && alignof(::nvfp4moe::{0}) == {align}, \"{0}: size disagrees with the generated Rust\");", s.name);
        for (f, off) in s.fields.iter().zip(&offsets) {
            let _ = writeln!(o, "static_assert(offsetof(::nvfp4moe::{0}, {1}) == {off} && sizeof(::nvfp4moe::{0}::{1}) == {2}, \"{0}::{1} disagrees with the generated Rust\");", s.name, f.name, f.ty.size_align().0);
        }
    }
    o
}
