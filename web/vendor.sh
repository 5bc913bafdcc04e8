#!/bin/sh
# Vendors uPlot (MIT) from the npm registry into web/vendor/, so the dashboard
# works offline and never loads code from a CDN. The result is committed;
# run again only to change the version: sh web/vendor.sh 1.6.32
set -eu
VERSION=${1:-1.6.32}
cd "$(dirname "$0")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack "uplot@$VERSION" --silent >/dev/null)
tar -xzf "$tmp/uplot-$VERSION.tgz" -C "$tmp"
mkdir -p vendor
cp "$tmp/package/dist/uPlot.iife.min.js" vendor/uplot.iife.min.js
cp "$tmp/package/dist/uPlot.min.css" vendor/uplot.min.css
cp "$tmp/package/LICENSE" vendor/uplot.LICENSE
echo "uPlot $VERSION, from the npm registry by web/vendor.sh" > vendor/VERSION
