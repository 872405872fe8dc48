// Go TLS programs for nettap's tests (issue 47): one binary, a mode per first argument, stdlib
// only (GO111MODULE=off). Everything printed to stdout is one line per event, so a test reads
// it line by line: "listening PORT", "ok SIZE", "status CODE LEN", "done", "ns MEDIAN MEAN".
//
// Mode api is the resource document's workload (shared/seeds/000: "a Go HTTP application making
// outbound TLS calls", bench/seeds.py): a plain HTTP server whose every GET /call makes one
// HTTPS GET of BACKEND/size/N (a keep-alive transport, HTTP/1.1) and answers with its body.
//
// Message bytes: msg(i, size)[k] = (i*131 + k*7 + size) % 251 for k in 0..size-1, i the
// message's index (tests/gobuild.py: msg() computes the same bytes in Python).
package main

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"
)

func msg(i, size int) []byte {
	b := make([]byte, size)
	for k := range b {
		b[k] = byte((i*131 + k*7 + size) % 251)
	}
	return b
}

func fail(f string, a ...interface{}) {
	fmt.Fprintf(os.Stderr, f+"\n", a...)
	os.Exit(1)
}

func tlsConfig(fs *flag.FlagSet, args []string, server bool) *tls.Config {
	cert := fs.String("cert", "", "certificate (PEM)")
	key := fs.String("key", "", "private key (PEM)")
	tls12 := fs.Bool("tls12", false, "cap the TLS version at 1.2")
	if err := fs.Parse(args); err != nil {
		fail("%v", err)
	}
	cfg := &tls.Config{InsecureSkipVerify: !server}
	if *tls12 {
		cfg.MaxVersion = tls.VersionTLS12
	}
	if server {
		c, err := tls.LoadX509KeyPair(*cert, *key)
		if err != nil {
			fail("certificate: %v", err)
		}
		cfg.Certificates = []tls.Certificate{c}
	}
	return cfg
}

// waitLine says "ready" and blocks until stdin gives one line (so a test can target the pid
// first). "ready" is the proof that the program runs: when Popen returns, the kernel may not
// have mapped the executable yet (its exec is past the point of no return, not done).
func waitLine(wait bool) {
	if wait {
		fmt.Println("ready")
		if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
			fail("stdin: %v", err)
		}
	}
}

func listen(cfg *tls.Config) net.Listener {
	ln, err := tls.Listen("tcp", "127.0.0.1:0", cfg)
	if err != nil {
		fail("listen: %v", err)
	}
	fmt.Printf("listening %d\n", ln.Addr().(*net.TCPAddr).Port)
	return ln
}

// serve runs handle on each connection accepted, a goroutine each.
func serve(mode string, args []string, handle func(net.Conn)) {
	fs := flag.NewFlagSet(mode, flag.ExitOnError)
	ln := listen(tlsConfig(fs, args, true))
	for {
		c, err := ln.Accept()
		if err != nil {
			fail("accept: %v", err)
		}
		go func(c net.Conn) {
			defer c.Close()
			handle(c)
		}(c)
	}
}

func echoServer(args []string) {
	serve("echo-server", args, func(c net.Conn) { io.Copy(c, c) })
}

// sinkServer reads and drops what each connection sends (bench/tls_cost.py's server).
func sinkServer(args []string) {
	serve("sink-server", args, func(c net.Conn) { io.Copy(io.Discard, c) })
}

// writeLoop writes n messages of size bytes, one (*Conn).Write each, and prints the median
// and mean ns of a Write as time.Now around each call sees it (bench/tls_cost.py).
func writeLoop(args []string) {
	fs := flag.NewFlagSet("write-loop", flag.ExitOnError)
	addr := fs.String("addr", "", "host:port")
	n := fs.Int("n", 10000, "messages")
	size := fs.Int("size", 64, "bytes a message")
	wait := fs.Bool("wait", false, "read a line from stdin before dialing")
	cfg := tlsConfig(fs, args, false)
	if *n < 1 {
		fail("-n %d: nothing to time", *n)
	}
	waitLine(*wait)
	c, err := tls.Dial("tcp", *addr, cfg)
	if err != nil {
		fail("dial: %v", err)
	}
	defer c.Close()
	m := msg(0, *size)
	took := make([]int64, *n)
	var sum int64
	for i := range took {
		t := time.Now()
		if _, err := c.Write(m); err != nil {
			fail("write: %v", err)
		}
		took[i] = int64(time.Since(t))
		sum += took[i]
	}
	sort.Slice(took, func(a, b int) bool { return took[a] < took[b] })
	fmt.Printf("ns %d %d\n", took[*n/2], sum/int64(*n))
}

func echoClient(args []string) {
	fs := flag.NewFlagSet("echo-client", flag.ExitOnError)
	addr := fs.String("addr", "", "host:port")
	sizes := fs.String("sizes", "1,396,16385,1048576", "message sizes")
	wait := fs.Bool("wait", false, "read a line from stdin before dialing")
	cfg := tlsConfig(fs, args, false)
	waitLine(*wait)
	c, err := tls.Dial("tcp", *addr, cfg)
	if err != nil {
		fail("dial: %v", err)
	}
	defer c.Close()
	for i, s := range strings.Split(*sizes, ",") {
		size, err := strconv.Atoi(s)
		if err != nil {
			fail("size %q: %v", s, err)
		}
		m := msg(i, size)
		back := make([]byte, size)
		// The echo is read while the message is written: a message larger than the socket
		// buffers both ways would otherwise block both ends.
		read := make(chan error)
		go func() {
			_, err := io.ReadFull(c, back)
			read <- err
		}()
		if _, err := c.Write(m); err != nil {
			fail("write: %v", err)
		}
		if err := <-read; err != nil {
			fail("read: %v", err)
		}
		if !bytes.Equal(m, back) {
			fail("echo of message %d (%d bytes) differs", i, size)
		}
		fmt.Printf("ok %d\n", size)
	}
	fmt.Println("done")
}

func httpsServer(args []string) {
	fs := flag.NewFlagSet("https-server", flag.ExitOnError)
	ln := listen(tlsConfig(fs, args, true))
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n, err := strconv.Atoi(strings.TrimPrefix(r.URL.Path, "/size/"))
		if r.Method != http.MethodGet || !strings.HasPrefix(r.URL.Path, "/size/") || err != nil || n < 0 {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Length", strconv.Itoa(n))
		w.Write(msg(0, n))
	})
	fail("serve: %v", http.Serve(ln, h))
}

func httpsGet(args []string) {
	fs := flag.NewFlagSet("https-get", flag.ExitOnError)
	url := fs.String("url", "", "URL to GET")
	n := fs.Int("n", 1, "number of GETs")
	wait := fs.Bool("wait", false, "read a line from stdin before the first GET")
	cfg := tlsConfig(fs, args, false)
	waitLine(*wait)
	// A Transport of our own: keep-alive on, HTTP/1.1 (TLSClientConfig set disables h2).
	cl := &http.Client{Transport: &http.Transport{TLSClientConfig: cfg}, Timeout: 30 * time.Second}
	for i := 0; i < *n; i++ {
		r, err := cl.Get(*url)
		if err != nil {
			fail("get: %v", err)
		}
		b, err := io.ReadAll(r.Body)
		r.Body.Close()
		if err != nil {
			fail("body: %v", err)
		}
		fmt.Printf("status %d %d\n", r.StatusCode, len(b))
	}
	fmt.Println("done")
}

// apiServer is mode api (see the top): plain HTTP in, one TLS call out a request.
func apiServer(args []string) {
	fs := flag.NewFlagSet("api", flag.ExitOnError)
	backend := fs.String("backend", "", "https://host:port of an https-server")
	size := fs.Int("size", 512, "bytes asked of the backend per call")
	cfg := tlsConfig(fs, args, false)
	tr := &http.Transport{TLSClientConfig: cfg, MaxIdleConnsPerHost: 256}
	cl := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	url := fmt.Sprintf("%s/size/%d", *backend, *size)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fail("listen: %v", err)
	}
	fmt.Printf("listening %d\n", ln.Addr().(*net.TCPAddr).Port)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/call" {
			http.NotFound(w, r)
			return
		}
		resp, err := cl.Get(url)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		defer resp.Body.Close()
		w.Header().Set("Content-Length", resp.Header.Get("Content-Length"))
		w.WriteHeader(resp.StatusCode)
		io.Copy(w, resp.Body)
	})
	fail("serve: %v", http.Serve(ln, h))
}

func main() {
	if len(os.Args) < 2 {
		fail("usage: %s echo-server|echo-client|https-server|https-get|sink-server|write-loop|api [flags]", os.Args[0])
	}
	modes := map[string]func([]string){"echo-server": echoServer, "echo-client": echoClient,
		"https-server": httpsServer, "https-get": httpsGet, "sink-server": sinkServer, "write-loop": writeLoop,
		"api": apiServer}
	run, ok := modes[os.Args[1]]
	if !ok {
		fail("unknown mode %q", os.Args[1])
	}
	run(os.Args[2:])
}
