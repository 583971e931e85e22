// Renders a Modelfile's TEMPLATE with Go's text/template (the engine Ollama runs) on a
// conversation, for comparison with the Jinja chat template's rendering (docs/gguf.md):
//
//	go run scripts/check_modelfile.go Modelfile
//
// The conversation: system, user, assistant, user (a generation prompt follows the last).
package main

import (
	"fmt"
	"os"
	"strings"
	"text/template"
)

type Message struct {
	Role    string
	Content string
}

func main() {
	b, err := os.ReadFile(os.Args[1])
	if err != nil {
		panic(err)
	}
	s := string(b)
	i := strings.Index(s, "TEMPLATE \"\"\"")
	if i < 0 {
		panic("no TEMPLATE")
	}
	s = s[i+len("TEMPLATE \"\"\""):]
	s = s[:strings.Index(s, "\"\"\"")]
	t := template.Must(template.New("m").Parse(s))
	msgs := []Message{{"system", "Be brief."}, {"user", "Hi there"}, {"assistant", "Hello!"}, {"user", "What is 2+2?"}}
	var out strings.Builder
	if err := t.Execute(&out, map[string]any{"Messages": msgs}); err != nil {
		panic(err)
	}
	fmt.Print(out.String())
}
