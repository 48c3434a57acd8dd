"""The Springback coordinator: gRPC servers, job and membership logic over etcd."""
