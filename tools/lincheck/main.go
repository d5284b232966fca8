// Command lincheck checks a recorded Pygmy client history for linearizability, one book at a time,
// with Porcupine. Usage: lincheck HISTORY.json [--html-dir DIR] [--timeout SECONDS]
//
// Exit status: 0 every book linearizable, 1 some book not (or its check timed out), 2 bad input.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/anishathalye/porcupine"
)

// book is the model state of one item: comparable, so Porcupine can cache and compare states with ==.
type book struct {
	Cost  int64 `json:"cost"`
	Stock int64 `json:"stock"`
}

type rawOp struct {
	Client   int             `json:"client"`
	Kind     string          `json:"kind"`
	Item     int             `json:"item"`
	Invoke   int64           `json:"invoke"`
	Complete *int64          `json:"complete"`
	Input    json.RawMessage `json:"input"`
	Output   json.RawMessage `json:"output"`
}

type history struct {
	Initial map[int]book `json:"initial"`
	Ops     []rawOp      `json:"ops"`
}

type input struct {
	Kind     string
	Delta    int64 // update
	SetCost  bool  // update: false means "cost unchanged"
	Cost     int64 // update
	Quantity int64 // buy
}

type output struct {
	Known      bool // false: outcome unknown (timeout, lost connection, ...)
	Book       book // lookup, update
	OutOfStock bool // buy: a definite 409
}

func step(state, in, out interface{}) (bool, interface{}) {
	s, i, o := state.(book), in.(input), out.(output)
	switch i.Kind {
	case "lookup":
		return !o.Known || s == o.Book, s
	case "update":
		next := book{s.Cost, s.Stock + i.Delta}
		if i.SetCost {
			next.Cost = i.Cost
		}
		if !o.Known && next.Stock < 0 { // if it happened, it was applied only when legal
			return true, s
		}
		return !o.Known || next.Stock >= 0 && next == o.Book, next
	default: // buy
		enough := s.Stock >= i.Quantity
		if o.Known && o.OutOfStock {
			return !enough, s
		}
		if !enough {
			return !o.Known, s
		}
		return true, book{s.Cost, s.Stock - i.Quantity}
	}
}

func money(c int64) string { return fmt.Sprintf("%d.%02d", c/100, c%100) }

func describeState(state interface{}) string {
	return fmt.Sprintf("%s/%d", money(state.(book).Cost), state.(book).Stock)
}

func describeOperation(in, out interface{}) string {
	i, o := in.(input), out.(output)
	call, res := i.Kind, "?"
	if i.Kind == "update" {
		call = fmt.Sprintf("update %+d", i.Delta)
		if i.SetCost {
			call += " @" + money(i.Cost)
		}
	} else if i.Kind == "buy" {
		call = fmt.Sprintf("buy %d", i.Quantity)
	}
	switch {
	case !o.Known:
	case i.Kind == "buy" && o.OutOfStock:
		res = "out of stock"
	case i.Kind == "buy":
		res = "ok"
	default:
		res = describeState(o.Book)
	}
	return call + " -> " + res
}

// model is per book: Init takes no argument, so a book's own initial state must be baked in.
func model(initial book) porcupine.Model {
	return porcupine.Model{
		Init:                      func() interface{} { return initial },
		Step:                      step,
		Equal:                     func(a, b interface{}) bool { return a.(book) == b.(book) },
		DescribeOperation:         describeOperation,
		DescribeState:             describeState,
		DescribeOperationMetadata: func(m interface{}) string { return fmt.Sprint(m) },
	}
}

// parseOp turns one recorded op of a modelled kind into its model input and output.
func parseOp(r rawOp) (in input, out output, err error) {
	var i struct {
		Delta    *int64 `json:"stock_delta"`
		Cost     *int64 `json:"cost"`
		Quantity *int64 `json:"quantity"`
	}
	var o struct {
		Cost, Stock *int64
		Ok          *bool
		OutOfStock  bool `json:"out_of_stock"`
	}
	in.Kind, out.Known = r.Kind, len(r.Output) > 0 && string(r.Output) != "null"
	if len(r.Input) > 0 {
		err = json.Unmarshal(r.Input, &i)
	}
	if err == nil && out.Known {
		err = json.Unmarshal(r.Output, &o)
	}
	switch {
	case err != nil:
		return in, out, err
	case out.Known && (r.Complete == nil || *r.Complete < r.Invoke):
		return in, out, fmt.Errorf("a known outcome needs complete >= invoke")
	case out.Known && r.Kind != "buy" && (o.Cost == nil || o.Stock == nil):
		return in, out, fmt.Errorf(`output must be {"cost": cents, "stock": n} or null`)
	case r.Kind == "update" && i.Delta == nil:
		return in, out, fmt.Errorf("update needs stock_delta")
	case r.Kind == "buy" && (i.Quantity == nil || *i.Quantity <= 0):
		return in, out, fmt.Errorf("buy needs a positive quantity")
	case r.Kind == "buy" && out.Known && (o.Ok == nil || *o.Ok == o.OutOfStock):
		return in, out, fmt.Errorf(`buy output must be {"ok": true}, {"ok": false, "out_of_stock": true} or null`)
	}
	if out.Known && r.Kind != "buy" {
		out.Book = book{*o.Cost, *o.Stock}
	}
	if r.Kind == "update" {
		in.Delta, in.SetCost = *i.Delta, i.Cost != nil
		if in.SetCost {
			in.Cost = *i.Cost
		}
	} else if r.Kind == "buy" {
		in.Quantity, out.OutOfStock = *i.Quantity, o.OutOfStock
	}
	return in, out, nil
}

func fail(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "lincheck: "+format+"\n", args...)
	os.Exit(2)
}

func main() {
	fs := flag.NewFlagSet("lincheck", flag.ExitOnError)
	htmlDir := fs.String("html-dir", "", "where to write visualizations (default: next to the history)")
	timeout := fs.Float64("timeout", 60, "seconds allowed per book (checked in parallel), 0 for no limit")
	var args []string
	for rest := os.Args[1:]; ; rest = fs.Args()[1:] { // flags may come before or after the file
		_ = fs.Parse(rest)
		if fs.NArg() == 0 {
			break
		}
		args = append(args, fs.Arg(0))
	}
	if len(args) != 1 {
		fail("usage: lincheck HISTORY.json [--html-dir DIR] [--timeout SECONDS]")
	}
	data, err := os.ReadFile(args[0])
	if err != nil {
		fail("%v", err)
	}
	var h history
	if err := json.Unmarshal(data, &h); err != nil {
		fail("%s: %v", args[0], err)
	}
	if *htmlDir == "" {
		*htmlDir = filepath.Dir(args[0])
	}

	// Unknown outcomes return "in the far future", after every other event, so Porcupine may place them last.
	var future int64
	for _, r := range h.Ops {
		future = max(future, r.Invoke+1)
		if r.Complete != nil {
			future = max(future, *r.Complete+1)
		}
	}
	// The visualization draws ClientId as a row index: give each book dense rows, one per client, and
	// unknown outcomes (which stretch to the end) rows of their own so they do not hide later ops.
	type row struct {
		item  int
		label string
	}
	byItem, rows, nrows, skipped := map[int][]porcupine.Operation{}, map[row]int{}, map[int]int{}, map[string]int{}
	for n, r := range h.Ops {
		if r.Kind != "lookup" && r.Kind != "update" && r.Kind != "buy" {
			skipped[r.Kind]++
			continue
		}
		in, out, err := parseOp(r)
		if err != nil {
			fail("op %d (%s): %v", n, r.Kind, err)
		}
		if _, ok := h.Initial[r.Item]; !ok {
			fail("op %d: item %d has no initial state", n, r.Item)
		}
		ret, key := future, row{r.Item, fmt.Sprintf("client %d (outcome unknown)", r.Client)}
		if out.Known {
			ret, key.label = *r.Complete, fmt.Sprintf("client %d", r.Client)
		}
		if _, seen := rows[key]; !seen {
			rows[key], nrows[r.Item] = nrows[r.Item], nrows[r.Item]+1
		}
		byItem[r.Item] = append(byItem[r.Item], porcupine.Operation{
			ClientId: rows[key], Input: in, Call: r.Invoke, Output: out, Return: ret, Metadata: key.label})
	}
	for kind, n := range skipped {
		fmt.Fprintf(os.Stderr, "lincheck: warning: ignored %d op(s) of unknown kind %q\n", n, kind)
	}

	items := slices.Sorted(maps.Keys(byItem))
	results := make([]porcupine.CheckResult, len(items))
	infos := make([]porcupine.LinearizationInfo, len(items))
	var wg sync.WaitGroup
	for n, item := range items { // one check per book, so each has its own verdict, timeout and HTML
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[n], infos[n] = porcupine.CheckOperationsVerbose(model(h.Initial[item]), byItem[item],
				time.Duration(*timeout*float64(time.Second)))
		}()
	}
	wg.Wait()

	summary := struct {
		Ok    bool           `json:"ok"`
		Items map[int]string `json:"items"`
		HTML  map[int]string `json:"html"`
	}{true, map[int]string{}, map[int]string{}}
	for n, item := range items {
		ops := len(byItem[item])
		switch results[n] {
		case porcupine.Ok:
			summary.Items[item] = "ok"
			fmt.Printf("item %d: ok (%d ops)\n", item, ops)
		case porcupine.Illegal:
			path := filepath.Join(*htmlDir, fmt.Sprintf("item-%d.html", item))
			err := os.MkdirAll(*htmlDir, 0o755)
			if err == nil {
				err = porcupine.VisualizePath(model(h.Initial[item]), infos[n], path)
			}
			if err != nil {
				fail("writing %s: %v", path, err)
			}
			summary.Ok, summary.Items[item], summary.HTML[item] = false, "illegal", path
			fmt.Printf("item %d: NOT linearizable (%d ops), visualization: %s\n", item, ops, path)
		default:
			summary.Ok, summary.Items[item] = false, "unknown"
			fmt.Printf("item %d: UNKNOWN, check timed out after %gs (%d ops)\n", item, *timeout, ops)
		}
	}
	line, _ := json.Marshal(summary)
	fmt.Println(string(line))
	if !summary.Ok {
		os.Exit(1)
	}
}
