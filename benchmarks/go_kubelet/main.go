// A DRA kubelet-side client in Go, for benchmarks/dra_prepare.py: the calls it times are made
// with grpc-go, as the kubelet makes them (unix socket, no TLS, a 45 s deadline per call), so the
// figure is the kubelet's own view of a call, without the Python stand-in's client in it.
//
// Usage: go_kubelet SOCKET. Reads one command per line on stdin:
//
//	prepare NAMESPACE NAME UID | unprepare NAMESPACE NAME UID | prepare | unprepare
//
// (no claim: a call with none) and answers each with one line: the call's nanoseconds, a space,
// and the answer as protojson (or {"grpcError": "..."}). Built by benchmarks/_go_kubelet.py
// against Go code generated from proto/dra/v1/api.proto; nothing generated is kept.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	dra "devplugd.bench/drapb"
)

// The kubelet's deadline for one NodePrepareResources / NodeUnprepareResources call.
const callTimeout = 45 * time.Second

// protoCodec marshals with google.golang.org/protobuf itself: Debian's grpc-go may come with
// github.com/golang/protobuf 1.3 (golang-github-golang-protobuf-1-3-dev, apt's first choice),
// whose codec cannot read the messages today's protoc-gen-go makes.
type protoCodec struct{}

func (protoCodec) Marshal(v interface{}) ([]byte, error) { return proto.Marshal(v.(proto.Message)) }
func (protoCodec) Unmarshal(b []byte, v interface{}) error {
	return proto.Unmarshal(b, v.(proto.Message))
}
func (protoCodec) Name() string { return "proto" }

func dial(socket string) (*grpc.ClientConn, error) {
	dialer := func(ctx context.Context, address string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", address)
	}
	return grpc.Dial(socket, grpc.WithInsecure(), grpc.WithContextDialer(dialer),
		grpc.WithDefaultCallOptions(grpc.ForceCodec(protoCodec{})))
}

// call makes one call; the answer as protojson, or the gRPC error as JSON.
func call(client dra.DRAPluginClient, fields []string) (time.Duration, string) {
	var claims []*dra.Claim
	if len(fields) == 4 {
		claims = []*dra.Claim{{Namespace: fields[1], Name: fields[2], Uid: fields[3]}}
	}
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	var answer proto.Message
	var err error
	started := time.Now()
	switch fields[0] {
	case "prepare":
		answer, err = client.NodePrepareResources(ctx, &dra.NodePrepareResourcesRequest{Claims: claims})
	case "unprepare":
		answer, err = client.NodeUnprepareResources(ctx, &dra.NodeUnprepareResourcesRequest{Claims: claims})
	default:
		err = fmt.Errorf("unknown command %q", fields[0])
	}
	took := time.Since(started)
	if err != nil {
		text, _ := json.Marshal(map[string]string{"grpcError": err.Error()})
		return took, string(text)
	}
	text, _ := protojson.Marshal(answer) // one line: protojson is multiline only when asked
	return took, string(text)
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: go_kubelet SOCKET")
		os.Exit(2)
	}
	conn, err := dial(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, "dial:", err)
		os.Exit(1)
	}
	defer conn.Close()
	client := dra.NewDRAPluginClient(conn)
	lines := bufio.NewScanner(os.Stdin)
	out := bufio.NewWriter(os.Stdout)
	for lines.Scan() {
		fields := strings.Fields(lines.Text())
		if len(fields) != 1 && len(fields) != 4 {
			fmt.Fprintf(out, "0 {\"grpcError\": \"bad command %q\"}\n", lines.Text())
		} else {
			took, answer := call(client, fields)
			fmt.Fprintf(out, "%d %s\n", took.Nanoseconds(), answer)
		}
		out.Flush()
	}
}
