// rejects: conversion function from 'SoloGroup' to 'Replicas' invokes a deleted function
// A load's replica group is one its caller keeps: a temporary group would be gone before the rows it
// should carry (and load_into takes no pointer that could be one).
#include <filesystem>
import shardckpt;
using namespace shardckpt;

void f(const std::filesystem::path& p, StateDict& s, ProcessGroup& g) { (void)load_into(p, s, g, {}, SoloGroup()); }
