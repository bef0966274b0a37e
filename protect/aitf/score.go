package aitf

import (
	"math"
	"strconv"
)

// Dimension indices, in vector order.
const (
	dimRecursion = iota
	dimNonInteractive
	dimContext
	dimChunking
	dimRetry
	dimToolCall
	dimMetadata
	dimSampling
	dimTrace
	dimEnumeration
	dimRepeat
	dimBurst
	dimCount
)

// Dimensions holds the stable short name of each vector dimension, in vector
// order; logs, the CLI and the package documentation use these names.
var Dimensions = [dimCount]string{
	"recursion",
	"noninteractive",
	"context",
	"chunking",
	"retry",
	"toolcall",
	"metadata",
	"sampling",
	"trace",
	"enumeration",
	"repeat",
	"burst",
}

// weights are the w_i of the noisy-OR; the package documentation's table is
// the reference. Every weight is below 1 so the score never reaches 1, and
// at least 0.45 so three full signals reach 0.8.
var weights = [dimCount]float64{
	dimRecursion:      0.65,
	dimNonInteractive: 0.50,
	dimContext:        0.45,
	dimChunking:       0.45,
	dimRetry:          0.45,
	dimToolCall:       0.70,
	dimMetadata:       0.50,
	dimSampling:       0.50,
	dimTrace:          0.50,
	dimEnumeration:    0.50,
	dimRepeat:         0.50,
	dimBurst:          0.50,
}

// Vector is the 12-dimension fingerprint of one request, each entry in [0,1],
// in the order of Dimensions.
type Vector [dimCount]float64

// String renders the vector compactly ("0.00,1.00,…"), for headers and logs.
func (v Vector) String() string {
	buf := make([]byte, 0, dimCount*5)
	for i, d := range v {
		if i > 0 {
			buf = append(buf, ',')
		}
		buf = strconv.AppendFloat(buf, d, 'f', 2, 64)
	}
	return string(buf)
}

// Score scans a raw JSON body and returns its combined score and vector.
// Only the body dimensions are filled; the behaviour dimensions need a
// visitor's history and stay 0. It never panics and does not allocate.
func Score(body []byte) (float64, Vector) {
	r := scan(body)
	return combine(r.vec), r.vec
}

// combine is the weighted noisy-OR: 1 − Π(1 − w_i·d_i).
func combine(v Vector) float64 {
	p := 1.0
	for i, d := range v {
		p *= 1 - weights[i]*clamp01(d)
	}
	return clamp01(1 - p)
}

// clamp01 maps x into [0,1]; NaN, which a hostile number could produce,
// counts as no signal.
func clamp01(x float64) float64 {
	switch {
	case math.IsNaN(x) || x <= 0:
		return 0
	case x >= 1:
		return 1
	}
	return x
}
