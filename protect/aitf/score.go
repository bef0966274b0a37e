package aitf

// weights.go is the output of the fit on the corpus's training part.
//go:generate go test -run ^TestFitWeights$ -update-weights

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

// combine is the fitted logistic model, measured from its no-evidence
// baseline: with z = bias + Σ w_i·d_i and p = σ(z),
//
//	score = (p − σ(bias)) / (1 − σ(bias))
//
// so a body with no signal at all scores exactly 0, every weight being
// non-negative each dimension can only raise the score, and the score
// stays in [0,1]. σ(bias) is small, so the score is within a few
// hundredths of the fitted probability p.
func combine(v Vector) float64 {
	z := bias
	for i, d := range v {
		// Most dimensions are 0; NaN, which a hostile number could
		// produce, fails d > 0 and counts as no signal.
		if d > 0 {
			z += weights[i] * min(d, 1)
		}
	}
	if z <= bias {
		return 0
	}
	return clamp01((sigmoid(z) - baseline) / (1 - baseline))
}

// baseline is σ(bias), the fitted probability of a body with no signal.
var baseline = sigmoid(bias)

// sigmoid is the logistic function.
func sigmoid(z float64) float64 { return 1 / (1 + math.Exp(-z)) }

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
