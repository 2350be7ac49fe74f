// The pod sandbox image's process (sandbox_image in the test cluster's containerd): it waits
// for SIGTERM or SIGINT and exits. Built static (CGO_ENABLED=0) into a FROM scratch image,
// since no registry is reachable for registry.k8s.io/pause.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	c := make(chan os.Signal, 1)
	signal.Notify(c, syscall.SIGTERM, syscall.SIGINT)
	<-c
}
