//! Policy components no Rust guest can easily be, built here from the contract: a core
//! module that exports every guest function with the right core signature (each body
//! traps) and declares the memories and tables a test asks for, wrapped into a component
//! by `wit-component`. It loads as a policy; what it declares decides whether it can be
//! instantiated.

use wasm_encoder::{
    CodeSection, ExportKind, ExportSection, Function, FunctionSection, Instruction, MemorySection,
    MemoryType, Module, RefType, TableSection, TableType, TypeSection, ValType,
};
use wit_parser::abi::{AbiVariant, WasmType};
use wit_parser::{Resolve, WorldItem};

/// What the synthetic policy's core module declares.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Linear memories, each of `memory_pages` 64 KiB pages.
    pub memories: u32,
    pub memory_pages: u64,
    /// One table of this many funcref elements (besides none else).
    pub table_elements: u64,
}

fn val(ty: WasmType) -> ValType {
    match ty {
        WasmType::I32 | WasmType::Pointer | WasmType::Length => ValType::I32,
        WasmType::I64 | WasmType::PointerOrI64 => ValType::I64,
        WasmType::F32 => ValType::F32,
        WasmType::F64 => ValType::F64,
    }
}

/// The component's bytes.
pub fn policy_component(shape: Shape) -> Vec<u8> {
    let mut resolve = Resolve::default();
    let wit = crate::support::repo_root().join("wit");
    let (package, _) = resolve.push_dir(&wit).expect("the contract parses");
    let world = resolve
        .select_world(&[package], Some("policy"))
        .expect("world policy");

    let mut types = TypeSection::new();
    let mut functions = FunctionSection::new();
    let mut exports = ExportSection::new();
    let mut code = CodeSection::new();
    let mut add = |name: &str, params: Vec<ValType>, results: Vec<ValType>| {
        let index = types.len();
        types.ty().function(params, results);
        functions.function(index);
        exports.export(name, ExportKind::Func, index);
        let mut body = Function::new([]);
        body.instruction(&Instruction::Unreachable);
        body.instruction(&Instruction::End);
        code.function(&body);
    };
    for (key, item) in &resolve.worlds[world].exports {
        let WorldItem::Interface { id, .. } = item else {
            continue;
        };
        let interface_name = resolve.name_world_key(key);
        for (name, function) in &resolve.interfaces[*id].functions {
            let signature = resolve.wasm_signature(AbiVariant::GuestExport, function);
            add(
                &format!("{interface_name}#{name}"),
                signature.params.into_iter().map(val).collect(),
                signature.results.into_iter().map(val).collect(),
            );
        }
    }
    add("cabi_realloc", vec![ValType::I32; 4], vec![ValType::I32]);

    let mut memories = MemorySection::new();
    for _ in 0..shape.memories.max(1) {
        memories.memory(MemoryType {
            minimum: shape.memory_pages,
            maximum: None,
            memory64: false,
            shared: false,
            page_size_log2: None,
        });
    }
    exports.export("memory", ExportKind::Memory, 0);
    let mut tables = TableSection::new();
    tables.table(TableType {
        element_type: RefType::FUNCREF,
        table64: false,
        minimum: shape.table_elements,
        maximum: None,
        shared: false,
    });

    let mut module = Module::new();
    module
        .section(&types)
        .section(&functions)
        .section(&tables)
        .section(&memories)
        .section(&exports)
        .section(&code);
    let mut bytes = module.finish();
    wit_component::embed_component_metadata(
        &mut bytes,
        &resolve,
        world,
        wit_component::StringEncoding::UTF8,
    )
    .expect("metadata");
    wit_component::ComponentEncoder::default()
        .module(&bytes)
        .expect("module")
        .validate(true)
        .encode()
        .expect("a component")
}
