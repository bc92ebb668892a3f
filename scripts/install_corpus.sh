#!/usr/bin/env bash
# Installs the training corpus of `kvzap-export train` (Debian packages; run as root). Sources, domains and
# licences: kvzap_export/train/sources.py. The legal texts (held out) come with base-files and CPython.
set -euo pipefail
if [ "$(id -u)" != 0 ]; then SUDO=sudo; else SUDO=; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
  bible-kjv bible-kjv-text dict-jargon debian-faq python3-doc debian-reference-en fortunes
