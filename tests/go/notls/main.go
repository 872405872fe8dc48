// A Go program that links no crypto/tls (nettap's tests, issue 47): goelf.inspect() returns
// None for it. Prints "sleeping", then sleeps until killed.
package main

import (
	"fmt"
	"time"
)

func main() {
	fmt.Println("sleeping")
	for {
		time.Sleep(time.Second)
	}
}
