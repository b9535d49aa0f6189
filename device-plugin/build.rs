//! Generates the kubelet gRPC APIs (device plugin v1beta1, pod resources v1, plugin registration v1,
//! DRA v1 and DRA resource health v1alpha1) with the protoc that
//! ships inside `protoc-bin-vendored`, so a build needs nothing installed by hand.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // prost-build reads PROTOC; setting it here keeps a system protoc (of another version) out
    std::env::set_var("PROTOC", protoc);
    tonic_prost_build::configure().build_server(true).build_client(true).compile_protos(
        &[
            "proto/deviceplugin/v1beta1/api.proto",
            "proto/podresources/v1/api.proto",
            "proto/pluginregistration/v1/api.proto",
            "proto/dra/v1/api.proto",
            "proto/dra-health/v1alpha1/api.proto",
        ],
        &["proto"],
    )?;
    Ok(())
}
