fn main() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("host/ is inside the workspace")
        .to_owned();
    println!(
        "cargo:rustc-env=TOKWATT_BUILT_PLUGIN_DIR={}",
        root.join("target/plugins/wasm32-wasip2/plugin").display()
    );
}
