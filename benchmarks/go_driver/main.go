// A reference DRA driver in Go for benchmarks/dra_prepare.py: the steps devplugd takes on the
// path of one NodePrepareResources / NodeUnprepareResources, taken by a grpc-go server, so the
// benchmark can print what the same work costs on the same machine without Python in it. It is
// a yardstick, not a driver: it checks no device against a host and serves no slices.
//
// Usage: API_TOKEN=... go_driver SOCKET API_SERVER DRIVER CDI_DIR DEVINFO_DIR STATE_DIR
//
// For each claim of a NodePrepareResources, as devplugd and the Go helper
// (k8s.io/dynamic-resource-allocation/kubeletplugin) do:
//
//  1. the claim is read from the API server (one GET, before the lock; plain HTTP with
//     keep-alive, as the stand-in serves it; API_TOKEN, when set, the bearer token) and must have the UID the kubelet named and an
//     allocation; the results of DRIVER are its devices;
//  2. under the one lock: a device-info file per device in DEVINFO_DIR (a temporary file
//     renamed, as on tmpfs), the claim's CDI spec in CDI_DIR (the same), each request's device
//     metadata (KEP-5304: STATE_DIR/metadata/<namespace>_<claim>/<request>/metadata.json, made
//     new, and a CDI spec mounting it), and the checkpoint of every prepared claim
//     (STATE_DIR/claims.<a|b>.json, one in-place write and fdatasync over the older of two
//     slots, as devplugd's claim book writes it);
//  3. the answer names each device with its CDI IDs.
//
// NodeUnprepareResources removes the same files and writes the checkpoint without the claim.
// One log line to stderr per call, as a driver logs. Built by benchmarks/_go_kubelet.py.
package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	dra "devplugd.bench/drapb"
)

const (
	claimGetTimeout = 10 * time.Second // devplugd's CLAIM_GET_TIMEOUT
	block           = 4096             // the checkpoint is padded to whole blocks, as devplugd's
)

// protoCodec: grpc-go 1.33's server codec, with google.golang.org/protobuf's marshalling (see
// go_kubelet/main.go for why).
type protoCodec struct{}

func (protoCodec) Marshal(v interface{}) ([]byte, error) { return proto.Marshal(v.(proto.Message)) }
func (protoCodec) Unmarshal(b []byte, v interface{}) error {
	return proto.Unmarshal(b, v.(proto.Message))
}
func (protoCodec) String() string { return "proto" }

// resourceClaim is what the driver reads of a ResourceClaim.
type resourceClaim struct {
	Metadata struct {
		UID string `json:"uid"`
	} `json:"metadata"`
	Status struct {
		Allocation *struct {
			Devices struct {
				Results []struct {
					Request string `json:"request"`
					Driver  string `json:"driver"`
					Pool    string `json:"pool"`
					Device  string `json:"device"`
				} `json:"results"`
			} `json:"devices"`
		} `json:"allocation"`
	} `json:"status"`
}

type preparedDevice struct {
	Request string   `json:"request"`
	Pool    string   `json:"pool"`
	Device  string   `json:"device"`
	CDIIDs  []string `json:"cdiDeviceIDs"`
}

type preparedClaim struct {
	Namespace string           `json:"namespace"`
	Name      string           `json:"name"`
	Devices   []preparedDevice `json:"devices"`
	Requests  []string         `json:"requests"`
}

type driver struct {
	dra.UnimplementedDRAPluginServer
	api, token, name, cdiDir, devinfoDir, stateDir string
	client                                         *http.Client

	mu       sync.Mutex // every Prepare and Unprepare, after its GETs
	claims   map[string]preparedClaim
	sequence int
}

func (d *driver) getClaim(ctx context.Context, ref *dra.Claim) (*resourceClaim, error) {
	ctx, cancel := context.WithTimeout(ctx, claimGetTimeout)
	defer cancel()
	url := fmt.Sprintf("%s/apis/resource.k8s.io/v1/namespaces/%s/resourceclaims/%s", d.api, ref.Namespace, ref.Name)
	request, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	request.Header.Set("Accept", "application/json")
	if d.token != "" {
		request.Header.Set("Authorization", "Bearer "+d.token)
	}
	response, err := d.client.Do(request)
	if err != nil {
		return nil, err
	}
	defer response.Body.Close()
	body, err := io.ReadAll(response.Body)
	if err != nil {
		return nil, err
	}
	if response.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s", url, response.Status)
	}
	claim := &resourceClaim{}
	return claim, json.Unmarshal(body, claim)
}

// writeRenamed writes a file as devplugd writes one on tmpfs: a temporary file renamed over it.
func writeRenamed(path string, data []byte) error {
	temporary := filepath.Join(filepath.Dir(path), fmt.Sprintf(".%s.%d.tmp", filepath.Base(path), os.Getpid()))
	if err := os.WriteFile(temporary, data, 0o644); err != nil {
		os.Remove(temporary)
		return err
	}
	return os.Rename(temporary, path)
}

// writeCheckpoint writes every prepared claim over the older slot, in place, and flushes it.
func (d *driver) writeCheckpoint() error {
	d.sequence++
	body, err := json.Marshal(map[string]interface{}{"sequence": d.sequence, "claims": d.claims})
	if err != nil {
		return err
	}
	sum := sha256.Sum256(body)
	data := append([]byte(`{"sha256":"`+hex.EncodeToString(sum[:])+`",`), body[1:]...)
	path := filepath.Join(d.stateDir, fmt.Sprintf("claims.%c.json", "ab"[d.sequence%2]))
	file, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE, 0o600)
	if err != nil {
		return err
	}
	defer file.Close()
	padded := (len(data) + block - 1) / block * block
	if info, err := file.Stat(); err == nil && int(info.Size()) > padded {
		padded = int(info.Size())
	}
	if _, err := file.WriteAt(append(data, bytes.Repeat([]byte(" "), padded-len(data))...), 0); err != nil {
		return err
	}
	return syscall.Fdatasync(int(file.Fd()))
}

func (d *driver) metadataPath(namespace, name, request string) string {
	return filepath.Join(d.stateDir, "metadata", namespace+"_"+name, request, "metadata.json")
}

func (d *driver) prepare(ref *dra.Claim, claim *resourceClaim) (*dra.NodePrepareResourceResponse, error) {
	if claim.Metadata.UID != ref.Uid {
		return nil, fmt.Errorf("claim %s/%s has UID %s, not %s", ref.Namespace, ref.Name, claim.Metadata.UID, ref.Uid)
	}
	if claim.Status.Allocation == nil {
		return nil, fmt.Errorf("claim %s/%s is not allocated", ref.Namespace, ref.Name)
	}
	prepared := preparedClaim{Namespace: ref.Namespace, Name: ref.Name}
	var specDevices []map[string]interface{}
	requests := map[string][]string{}
	for _, result := range claim.Status.Allocation.Devices.Results {
		if result.Driver != d.name {
			continue
		}
		request := strings.SplitN(result.Request, "/", 2)[0]
		info, _ := json.Marshal(map[string]interface{}{"type": "pci", "version": "1.1.0",
			"pci": map[string]string{"pci-address": result.Device}})
		if err := writeRenamed(filepath.Join(d.devinfoDir, ref.Uid+"-"+result.Device+".json"), info); err != nil {
			return nil, err
		}
		cdiName := ref.Uid + "-" + result.Device
		specDevices = append(specDevices, map[string]interface{}{"name": cdiName, "containerEdits": map[string]interface{}{
			"env": []string{"PCIDEVICE_DEVPLUGD_IO=" + result.Device}}})
		requests[request] = append(requests[request], result.Device)
		prepared.Devices = append(prepared.Devices, preparedDevice{Request: result.Request, Pool: result.Pool,
			Device: result.Device, CDIIDs: []string{d.name + "/claim=" + cdiName, d.name + "/claim=" + ref.Uid + "_" + request}})
	}
	if len(prepared.Devices) == 0 {
		return &dra.NodePrepareResourceResponse{}, nil
	}
	spec, _ := json.Marshal(map[string]interface{}{"cdiVersion": "0.6.0", "kind": d.name + "/claim", "devices": specDevices})
	if err := writeRenamed(filepath.Join(d.cdiDir, d.name+"-"+ref.Uid+".json"), spec); err != nil {
		return nil, err
	}
	for request, devices := range requests {
		path := d.metadataPath(ref.Namespace, ref.Name, request)
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			return nil, err
		}
		document, _ := json.MarshalIndent(map[string]interface{}{"apiVersion": "metadata.resource.k8s.io/v1alpha1",
			"kind": "DeviceMetadata", "request": request, "devices": devices,
			"attributes": map[string]string{"pciAddress": devices[0], "padding": strings.Repeat("m", 700)}}, "", "  ")
		if err := os.WriteFile(path, document, 0o644); err != nil {
			return nil, err
		}
		mount, _ := json.Marshal(map[string]interface{}{"cdiVersion": "0.6.0", "kind": d.name + "/claim", "devices": []interface{}{
			map[string]interface{}{"name": ref.Uid + "_" + request, "containerEdits": map[string]interface{}{"mounts": []interface{}{
				map[string]interface{}{"hostPath": path, "containerPath": "/var/run/dra-device-attributes/" + request,
					"options": []string{"ro", "bind"}}}}}}})
		if err := writeRenamed(filepath.Join(d.cdiDir, d.name+"_metadata_"+ref.Uid+"_"+request+".json"), mount); err != nil {
			return nil, err
		}
		prepared.Requests = append(prepared.Requests, request)
	}
	sort.Strings(prepared.Requests)
	d.claims[ref.Uid] = prepared
	if err := d.writeCheckpoint(); err != nil {
		delete(d.claims, ref.Uid)
		return nil, fmt.Errorf("cannot write the checkpoint: %w", err)
	}
	return prepared.answer(), nil
}

// answer is the kubelet's answer for a prepared claim: its devices with their CDI IDs.
func (claim preparedClaim) answer() *dra.NodePrepareResourceResponse {
	answer := &dra.NodePrepareResourceResponse{}
	for _, device := range claim.Devices {
		answer.Devices = append(answer.Devices, &dra.Device{RequestNames: []string{device.Request},
			PoolName: device.Pool, DeviceName: device.Device, CdiDeviceIds: device.CDIIDs})
	}
	return answer
}

func (d *driver) NodePrepareResources(ctx context.Context, request *dra.NodePrepareResourcesRequest) (*dra.NodePrepareResourcesResponse, error) {
	claims := make([]*resourceClaim, len(request.Claims))
	failures := make([]error, len(request.Claims))
	for i, ref := range request.Claims {
		if _, known := d.known(ref.Uid); !known {
			claims[i], failures[i] = d.getClaim(ctx, ref)
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	answers := &dra.NodePrepareResourcesResponse{Claims: map[string]*dra.NodePrepareResourceResponse{}}
	for i, ref := range request.Claims {
		var answer *dra.NodePrepareResourceResponse
		err := failures[i]
		if known, ok := d.claims[ref.Uid]; ok {
			answer = known.answer()
		} else if err == nil {
			answer, err = d.prepare(ref, claims[i])
		}
		if err != nil {
			answer = &dra.NodePrepareResourceResponse{Error: err.Error()}
			log.Printf("not preparing %s/%s (UID %s): %v", ref.Namespace, ref.Name, ref.Uid, err)
		} else {
			log.Printf("prepared %s/%s (UID %s): %d devices", ref.Namespace, ref.Name, ref.Uid, len(answer.Devices))
		}
		answers.Claims[ref.Uid] = answer
	}
	return answers, nil
}

func (d *driver) known(uid string) (preparedClaim, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	claim, ok := d.claims[uid]
	return claim, ok
}

func (d *driver) NodeUnprepareResources(ctx context.Context, request *dra.NodeUnprepareResourcesRequest) (*dra.NodeUnprepareResourcesResponse, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	answers := &dra.NodeUnprepareResourcesResponse{Claims: map[string]*dra.NodeUnprepareResourceResponse{}}
	for _, ref := range request.Claims {
		answer := &dra.NodeUnprepareResourceResponse{}
		answers.Claims[ref.Uid] = answer
		claim, ok := d.claims[ref.Uid]
		if !ok {
			continue
		}
		for _, request := range claim.Requests {
			path := d.metadataPath(claim.Namespace, claim.Name, request)
			os.Remove(path)
			os.Remove(filepath.Dir(path))
			os.Remove(filepath.Dir(filepath.Dir(path)))
			os.Remove(filepath.Join(d.cdiDir, d.name+"_metadata_"+ref.Uid+"_"+request+".json"))
		}
		for _, device := range claim.Devices {
			os.Remove(filepath.Join(d.devinfoDir, ref.Uid+"-"+device.Device+".json"))
		}
		os.Remove(filepath.Join(d.cdiDir, d.name+"-"+ref.Uid+".json"))
		delete(d.claims, ref.Uid)
		if err := d.writeCheckpoint(); err != nil {
			answer.Error = "cannot write the checkpoint: " + err.Error()
		}
		log.Printf("unprepared %s/%s (UID %s)", ref.Namespace, ref.Name, ref.Uid)
	}
	return answers, nil
}

func main() {
	if len(os.Args) != 7 {
		fmt.Fprintln(os.Stderr, "usage: go_driver SOCKET API_SERVER DRIVER CDI_DIR DEVINFO_DIR STATE_DIR")
		os.Exit(2)
	}
	d := &driver{api: os.Args[2], token: os.Getenv("API_TOKEN"), name: os.Args[3], cdiDir: os.Args[4], devinfoDir: os.Args[5],
		stateDir: os.Args[6], claims: map[string]preparedClaim{},
		client: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4, IdleConnTimeout: 90 * time.Second}}}
	for _, directory := range []string{d.cdiDir, d.devinfoDir, d.stateDir} {
		if err := os.MkdirAll(directory, 0o755); err != nil {
			log.Fatal(err)
		}
	}
	listener, err := net.Listen("unix", os.Args[1])
	if err != nil {
		log.Fatal(err)
	}
	server := grpc.NewServer(grpc.CustomCodec(protoCodec{}))
	dra.RegisterDRAPluginServer(server, d)
	fmt.Println("serving") // the benchmark waits for this line
	if err := server.Serve(listener); err != nil {
		log.Fatal(err)
	}
}
